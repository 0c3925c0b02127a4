"""DockerProvider's snapshots on the real daemon: forks start as the snapshot and are isolated both ways,
their limits, env and uid their own; hostile paths, ids and descriptors; a second provider uses the
descriptor; nothing is left behind (containers, helpers and images, found by this test's label)."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from sandbox_middleware import (
    DockerProvider,
    Sandbox,
    SandboxArgumentError,
    SandboxHandle,
    SandboxPathError,
    SandboxSnapshot,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
    SandboxStatus,
    SupportsSandboxSnapshot,
)
from sandbox_middleware.providers._common._limits import Budget
from sandbox_middleware.providers.docker._archive import TarEntries
from sandbox_middleware.providers.docker._snapshots import REPOSITORY, SNAPSHOT, _renamer, _rewritten

from ._support import (
    BUSYBOX,
    PYTHON,
    SESSION,
    SESSION_KEY,
    TAG,
    cannot_hold,
    engine,
    images,
    on_daemon,
    one_spare,
    tagged,
)

pytestmark = pytest.mark.anyio

_FILES = "mkdir -p src/deep && echo one > src/a.txt && echo two > src/deep/b.txt && ln -s a.txt src/link"


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:12]


def _meta(tag: str, **more: str) -> dict[str, str]:
    """A snapshot's metadata in this session and test: its image is found (and removed) by their labels."""
    return {SESSION_KEY: SESSION, TAG: tag, **more}


def _left(tag: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The containers (sandboxes, spares, helpers) and snapshot images of this test still on the daemon."""
    return on_daemon(tag), images(f"sandbox_middleware.docker.meta.{TAG}={tag}")


async def _done(
    provider: DockerProvider,
    tag: str,
    *handles: SandboxHandle,
    deleted: tuple[SandboxSnapshot, ...] = (),
    aclose: bool = False,
) -> None:
    """Delete ``deleted``, close ``handles`` (``aclose``: and the provider, its spare): nothing of this test
    is left on the daemon."""
    for snapshot in deleted:
        await provider.delete_snapshot(snapshot)
    assert await provider.list_snapshots(metadata={TAG: tag}) == []  # images, and records on the host
    for handle in handles:
        await provider.close(handle)
    if aclose:
        await provider.aclose()
    with anyio.move_on_after(120):  # a helper's removal the provider stopped waiting for (30 s) goes on
        while any(container["State"] == "removing" for container in on_daemon(tag)):
            await anyio.sleep(0.5)
    assert _left(tag) == ([], [])


async def _out(provider: DockerProvider, handle: object, command: str) -> str:
    result = await provider.exec(handle, command)  # type: ignore[arg-type]
    assert result.return_code == 0, result
    return result.stdout or ""


async def test_forks_start_as_the_snapshot_and_are_isolated_both_ways(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Files written before the snapshot are in every fork, owned by the fork's own uid (a symlink kept
    as a link); a file written in one fork is in no other and not in the parent; the parent keeps running
    and changing without touching the forks; /tmp is not in a snapshot of the work directory."""
    provider = make(prestart=False)
    assert isinstance(provider, SupportsSandboxSnapshot)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, f"{_FILES} && echo scratch > /tmp/scratch")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    assert snapshot.provider == "docker" and snapshot.size_bytes == len("one\ntwo\n")
    assert snapshot.metadata == _meta(tag)
    assert await provider.status(parent) == SandboxStatus.RUNNING
    await _out(provider, parent, "echo changed > src/a.txt && echo new > src/parent-only")
    forks = [await provider.create(tagged(tag), from_snapshot=snapshot) for _ in range(2)]
    uids = {await _out(provider, box, "id -u") for box in (parent, *forks)}
    assert len(uids) == 3, "each sandbox has a uid of its own"
    for fork in forks:
        listing = await _out(provider, fork, "cat src/a.txt src/deep/b.txt; readlink src/link; ls src; ls -A /tmp")
        assert listing == "one\ntwo\na.txt\na.txt\ndeep\nlink\n"
        owners = await _out(provider, fork, "stat -c %u src src/a.txt src/deep src/deep/b.txt; id -u")
        assert len(set(owners.split())) == 1, owners
    await _out(provider, forks[0], "echo mine > src/fork-only && rm src/deep/b.txt")
    assert await _out(provider, forks[1], "ls src; ls src/deep") == "a.txt\ndeep\nlink\nb.txt\n"
    assert await _out(provider, parent, "ls src; cat src/a.txt") == "a.txt\ndeep\nlink\nparent-only\nchanged\n"
    await provider.delete_snapshot(snapshot)
    assert await _out(provider, forks[1], "cat src/a.txt") == "one\n", "forks run on once the snapshot is deleted"
    await _done(provider, tag, parent, *forks)


async def test_a_fork_has_its_own_spec_limits_env_files_and_ttl(make: Callable[..., DockerProvider], tag: str) -> None:
    """A fork is made from its own spec: memory, env, spec.files (written over the snapshot's) and TTL; the
    parent's env is nowhere in it (the snapshot image is not a commit of the parent's container)."""
    provider = make(prestart=False, host_files=False)
    parent = await provider.create(tagged(tag, env={"SECRET": "parent"}, resources={"memory_mib": 256}))
    await _out(provider, parent, "echo parent > note && echo kept > other")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    spec = tagged(tag, env={"MINE": "fork"}, resources={"memory_mib": 128}, files={"note": "fork\n"}, ttl_s=600)
    fork = await provider.create(spec, from_snapshot=snapshot)
    assert await _out(provider, fork, 'cat note other; echo "$MINE ${SECRET:-none}"') == "fork\nkept\nfork none\n"
    with engine() as client:
        info = client.get(f"/containers/{fork.sandbox_id}/json").json()
        image = client.get(f"/images/{REPOSITORY}:{snapshot.snapshot_id}/json").json()
    assert info["HostConfig"]["Memory"] == 128 << 20
    assert info["HostConfig"]["ReadonlyRootfs"]
    assert await _out(provider, fork, "grep CapBnd /proc/self/status") == "CapBnd:\t0000000000000000\n"
    assert "sandbox_middleware.docker.expires_at" in info["Config"]["Labels"]
    assert not any("SECRET" in variable for variable in image["Config"]["Env"] or [])
    await _done(provider, tag, parent, fork, deleted=(snapshot,))


async def test_paths_relative_absolute_and_in_tmp(make: Callable[..., DockerProvider], tag: str) -> None:
    """``paths``: relative to the work directory or absolute in a writable directory; only those are kept."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, f"{_FILES} && mkdir other && echo x > other/x && echo t > /tmp/t && echo u > /tmp/u")
    snapshot = await provider.snapshot(
        parent, paths=["src/deep", "/workspace/src/deep/b.txt", "/tmp/t"], metadata=_meta(tag)
    )
    fork = await provider.create(tagged(tag), from_snapshot=snapshot)
    assert await _out(provider, fork, "ls -R /workspace; ls /tmp") == (
        "/workspace:\nsrc\n\n/workspace/src:\ndeep\n\n/workspace/src/deep:\nb.txt\nt\n"
    )
    await _done(provider, tag, parent, fork, deleted=(snapshot,))


@pytest.mark.parametrize(
    "path", ["../escape", "/etc", "/etc/passwd", "/workspace/../etc", "link-out", "link-in", "link-dir/file", "gone"]
)
async def test_hostile_snapshot_paths_are_refused_and_read_nothing(
    make: Callable[..., DockerProvider], tag: str, path: str
) -> None:
    """A path outside the writable directories, a symlink named or on the way (wherever it points), a
    missing path: typed errors, no image made, the sandbox running again afterwards."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(
        provider, parent, "mkdir d && echo f > d/file && ln -s /etc link-out && ln -s d link-in && ln -s d link-dir"
    )
    error = SandboxSnapshotError if path == "gone" else SandboxPathError
    with pytest.raises(error):
        await provider.snapshot(parent, paths=[path], metadata=_meta(tag))
    assert await provider.status(parent) == SandboxStatus.RUNNING
    assert await _out(provider, parent, "cat d/file") == "f\n"
    await _done(provider, tag, parent)


async def test_a_symlink_inside_is_kept_as_a_link_and_nothing_is_read_through_it(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "ln -s /etc/passwd passwd && ln -s / root && echo x > x")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    assert snapshot.size_bytes == 2, "only the regular file's bytes: no target was read"
    fork = await provider.create(tagged(tag), from_snapshot=snapshot)
    assert await _out(provider, fork, "readlink passwd; readlink root; cat x") == "/etc/passwd\n/\nx\n"
    await _done(provider, tag, parent, fork, deleted=(snapshot,))


async def test_the_descriptor_round_trips_and_serves_a_second_provider(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Pickled and through JSON, the descriptor is used by another provider instance (another process's,
    as a Ray worker's): it lists, creates from and deletes the snapshot; then nobody finds it."""
    first, second = make(prestart=False), make(prestart=False)
    parent = await first.create(tagged(tag))
    await _out(first, parent, _FILES)
    snapshot = await first.snapshot(parent, metadata=_meta(tag, stage="prepared"))
    for copy in (
        pickle.loads(pickle.dumps(snapshot)),
        SandboxSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))),
    ):
        assert copy == snapshot
    assert await second.list_snapshots(metadata={TAG: tag, "stage": "prepared"}) == [snapshot]
    assert await second.list_snapshots(metadata={TAG: tag, "stage": "other"}) == []
    fork = await second.create(tagged(tag), from_snapshot=SandboxSnapshot.from_dict(snapshot.to_dict()))
    assert await _out(second, fork, "cat src/a.txt") == "one\n"
    await second.delete_snapshot(pickle.loads(pickle.dumps(snapshot)))
    assert await first.list_snapshots(metadata={TAG: tag}) == []
    for provider in (first, second):
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.create(tagged(tag), from_snapshot=snapshot)
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.delete_snapshot(snapshot)
    await second.close(fork)
    await _done(first, tag, parent)


async def test_hostile_descriptors_are_not_found_and_nothing_is_removed(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """A changed descriptor (metadata, time, size, provider), an id naming another image (the base image's,
    a tag, a path), a forged image of another daemon: ``SandboxSnapshotNotFoundError`` for create and
    delete, and every image is still there."""
    provider = make(prestart=False, host_files=False)
    parent = await provider.create(tagged(tag))
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    with engine() as client:
        base = client.get(f"/images/{BUSYBOX}/json").json()["Id"]
        forged = _forge_other_daemon(client, tag)
    changed = snapshot.to_dict()
    hostile = [
        SandboxSnapshot.from_dict({**changed, "metadata": {**snapshot.metadata, "run": "other"}}),
        SandboxSnapshot.from_dict({**changed, "metadata": {}}),
        SandboxSnapshot.from_dict({**changed, "created": snapshot.created + 1}),
        SandboxSnapshot.from_dict({**changed, "size_bytes": snapshot.size_bytes + 1}),
        SandboxSnapshot.from_dict({**changed, "provider": "local"}),
        *(
            SandboxSnapshot.from_dict({**changed, "snapshot_id": bad})
            for bad in (base, base.removeprefix("sha256:"), BUSYBOX, "../../etc", "a" * 32, forged)
        ),
    ]
    for descriptor in hostile:
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.create(tagged(tag), from_snapshot=descriptor)
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.delete_snapshot(descriptor)
    with pytest.raises(SandboxArgumentError):
        await provider.create(tagged(tag), from_snapshot={"snapshot_id": snapshot.snapshot_id})  # type: ignore[arg-type]
    with engine() as client:
        assert client.get(f"/images/{BUSYBOX}/json").status_code == 200
        assert client.get(f"/images/{REPOSITORY}:{forged}/json").status_code == 200
    assert len(images(f"sandbox_middleware.docker.meta.{TAG}={tag}")) == 2
    assert [listed.snapshot_id for listed in await provider.list_snapshots(metadata={TAG: tag})] == [
        snapshot.snapshot_id
    ]
    with engine() as client:
        client.delete(f"/images/{REPOSITORY}:{forged}", params={"force": "1", "noprune": "1"})
    await _done(provider, tag, parent, deleted=(snapshot,))


def _forge_other_daemon(client: httpx.Client, tag: str) -> str:
    """An image tagged and labelled as a snapshot of this provider, but of another daemon (its daemon label),
    as a copy loaded from another host would be; its snapshot id."""
    forged = uuid.uuid4().hex
    labels = {f"sandbox_middleware.docker.meta.{key}": value for key, value in _meta(tag).items()}
    labels |= {
        SNAPSHOT: forged,
        f"{SNAPSHOT}.provider": "docker",
        f"{SNAPSHOT}.daemon": "another-daemon",
        f"{SNAPSHOT}.created": "1.0",
        f"{SNAPSHOT}.size": "0",
        f"{SNAPSHOT}.parts": "",
    }
    made = client.post("/containers/create", json={"Image": BUSYBOX, "Cmd": ["true"], "Labels": labels})
    container = made.raise_for_status().json()["Id"]
    try:
        params = {"container": container, "repo": REPOSITORY, "tag": forged, "pause": "false"}
        client.post("/commit", params=params, json={}).raise_for_status()
    finally:
        client.delete(f"/containers/{container}")
    return forged


async def test_a_fork_must_run_the_snapshots_image_and_fit_its_own_disk(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Another image than the one the snapshot was taken of, and a work directory too small for the
    snapshot's files: ``SandboxSnapshotError`` (not retried), no container made."""
    provider, small = make(prestart=False), make(prestart=False, disk_gib=1 / 1024)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "head -c 2000000 /dev/zero > big")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    with pytest.raises(SandboxSnapshotError, match="was taken of a sandbox of image"):
        await provider.create(tagged(tag, image=PYTHON), from_snapshot=snapshot)
    with pytest.raises(SandboxSnapshotError, match="more than the new sandbox's"):
        await small.create(tagged(tag), from_snapshot=snapshot)
    assert [container["Id"] for container in on_daemon(tag)] == [parent.sandbox_id]
    await _done(provider, tag, parent, deleted=(snapshot,))


@pytest.mark.parametrize("where", ["sparse", "/tmp/sparse"])
async def test_a_sparse_file_past_its_directorys_size_is_refused(
    make: Callable[..., DockerProvider], tag: str, where: str
) -> None:
    """A sparse file (no room taken in its tmpfs) of more bytes than its writable directory holds would be
    written out whole into the snapshot's image, on the daemon's disk: refused as past the directory's
    size (disk_gib, tmp_mib), no image and no helper left."""
    provider = make(prestart=False, disk_gib=1 / 256, tmp_mib=4)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, f"truncate -s 64M {where}")
    with pytest.raises(SandboxSnapshotError, match=r"disk limit \(disk_gib or tmp_mib; a sparse file counts whole\)"):
        await provider.snapshot(parent, paths=[where], metadata=_meta(tag))
    assert await provider.status(parent) == SandboxStatus.RUNNING
    await _done(provider, tag, parent)


async def test_more_entries_than_the_directorys_size_allows_are_refused(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Empty directories take no room in a tmpfs but a block each on the daemon's disk: more entries than
    LocalProvider's tmpfs of that size holds (65,536 for a small one) are refused, no image left (a work
    directory on the host, ``_files.py``, holds no more: its tmpfs has that bound)."""
    provider = make(prestart=False, disk_gib=1 / 256, host_files=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "mkdir many && cd many && seq 66000 | xargs mkdir")
    with pytest.raises(SandboxSnapshotError, match="more than 65536 entries"):
        await provider.snapshot(parent, metadata=_meta(tag))
    await _done(provider, tag, parent)


async def test_a_snapshot_is_taken_paused_and_leaves_a_paused_sandbox_paused(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Consistent as of one moment: the sandbox is paused while it is read, so two files a command keeps
    rewriting (``a`` then ``b``, the same counter) are in the snapshot as they were at one instant
    (``b`` at most one behind ``a``, or one of them being rewritten); a sandbox its user paused stays paused."""
    cannot_hold("podman", "its archive API sees a paused container's tmpfs mounts empty: snapshots do not pause there")
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "head -c 30000000 /dev/zero > ballast")
    loop = "i=0; while [ ! -e /tmp/stop ]; do echo $i > a; echo $i > b; i=$((i+1)); done"
    states: list[SandboxStatus] = []

    async def watch() -> None:
        while True:
            states.append(await provider.status(parent))
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as group:
        group.start_soon(partial(provider.exec, parent, loop, timeout_s=120))
        await anyio.sleep(0.3)
        async with anyio.create_task_group() as watching:
            watching.start_soon(watch)
            snapshot = await provider.snapshot(parent, metadata=_meta(tag))
            watching.cancel_scope.cancel()
        await _out(provider, parent, "touch /tmp/stop")
    assert SandboxStatus.PAUSED in states and await provider.status(parent) == SandboxStatus.RUNNING
    fork = await provider.create(tagged(tag), from_snapshot=snapshot)
    a, b = (await _out(provider, fork, "cat a; echo /; cat b")).split("/")
    # One instant of "a=i; b=i": a being rewritten (empty) with b at i-1, a written, b being rewritten, both at i.
    assert a.strip() or b.strip(), (a, b)
    assert not (a.strip() and b.strip()) or int(a) - int(b) in (0, 1), (a, b)
    await provider.pause(parent)
    again = await provider.snapshot(parent, metadata=_meta(tag))
    assert await provider.status(parent) == SandboxStatus.PAUSED
    await provider.resume(parent)
    await _done(provider, tag, parent, fork, deleted=(snapshot, again))


async def test_sandbox_fork_through_the_facade(make: Callable[..., DockerProvider], tag: str) -> None:
    """``Sandbox.fork(3)``: three started forks of the state, the snapshot deleted once they are made."""
    provider = make(prestart=False)
    async with Sandbox(provider, tagged(tag)) as sandbox:
        await sandbox.exec(_FILES)
        async with sandbox.fork(3) as forks:
            assert [(await fork.exec("cat src/a.txt")).stdout for fork in forks] == ["one\n"] * 3
            assert await provider.list_snapshots(metadata={TAG: tag}) == []
    assert _left(tag) == ([], [])


async def test_a_fork_may_take_a_spare_of_its_shape(make: Callable[..., DockerProvider], tag: str) -> None:
    """A spare of the fork's shape is a container as its create would make (its spec's image, its own uid):
    taken, it is given the snapshot's files before it is handed out."""
    provider = make()
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, _FILES)
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    spare = await one_spare(tag, kept_by=provider)
    fork = await provider.create(tagged(tag), from_snapshot=snapshot)
    assert fork.sandbox_id == spare["Id"]
    contents, owner, uid = (await _out(provider, fork, "cat src/a.txt; stat -c %u src/a.txt; id -u")).split()
    assert contents == "one" and owner == uid
    await _done(provider, tag, parent, fork, deleted=(snapshot,), aclose=True)


# --- the archive rewriting, without a daemon -------------------------------------------------------


def _archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644, link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.linkname, info.uid = kind, len(data), mode, link, 1_500_000_123
    return info, data


async def _rewrite(archive: bytes, source: str, prefix: list[str]) -> list[tarfile.TarInfo]:
    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(archive), 333):
            yield archive[start : start + 333]

    entries = TarEntries(chunks(), "the test's archive")
    out = b"".join([piece async for piece in _rewritten(entries, _renamer(source, prefix), (7, 8), Budget(None))])
    with tarfile.open(fileobj=io.BytesIO(out)) as archive_out:
        return archive_out.getmembers()


async def test_an_archive_is_renamed_owned_and_stripped_of_what_a_snapshot_does_not_keep() -> None:
    """Long names (PAX) survive; every entry is the new owner's; setuid and setgid go, devices are left
    out; a symlink's target is kept as it is, a hard link renamed like its file."""
    long = "src/" + "d" * 150 + "/file"
    archive = _archive(
        _member("src", tarfile.DIRTYPE, mode=0o755),
        _member(long, data=b"payload", mode=0o6755),
        _member("src/link", tarfile.SYMTYPE, link="/etc/passwd"),
        _member("src/hard", tarfile.LNKTYPE, link=long),
        _member("src/null", tarfile.CHRTYPE),
        _member("src/fifo", tarfile.FIFOTYPE),
    )
    members = await _rewrite(archive, "src", [".snap", "work"])
    assert [member.name for member in members] == [
        ".snap/work",
        f".snap/work/{long[4:]}",
        ".snap/work/link",
        ".snap/work/hard",
        ".snap/work/fifo",
    ]
    assert all((member.uid, member.gid) == (7, 8) for member in members)
    assert members[1].mode == 0o755 and members[2].linkname == "/etc/passwd"
    assert members[3].linkname == f".snap/work/{long[4:]}"


@pytest.mark.parametrize("name", ["other/x", "src/../etc/x", "src//x", "src/./x"])
async def test_an_entry_outside_the_archived_path_is_refused(name: str) -> None:
    with pytest.raises(SandboxSnapshotError, match="outside"):
        await _rewrite(_archive(_member("src", tarfile.DIRTYPE), _member(name, data=b"x")), "src", ["work"])


async def test_a_hard_link_out_of_the_archive_is_refused() -> None:
    archive = _archive(_member("src", tarfile.DIRTYPE), _member("src/h", tarfile.LNKTYPE, link="../etc/passwd"))
    with pytest.raises(SandboxSnapshotError):
        await _rewrite(archive, "src", ["work"])
