"""LocalProvider's snapshots and forks (``_snapshots.py``, ``_copies.py``), under real bwrap: forks start
as the snapshot, are isolated from each other and from the parent both ways, keep their own spec's
limits; hostile paths, ids and deleted snapshots are typed errors; a descriptor works from another
provider on the same base_dir; a deleted snapshot outlives its last fork only; a half-made one is swept."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from sandbox_middleware import (
    LocalProvider,
    Sandbox,
    SandboxHandle,
    SandboxPathError,
    SandboxSnapshot,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
    SandboxSpec,
    SupportsSandboxSnapshot,
)
from sandbox_middleware.providers.local._cgroups import CgroupBackend
from tests.leftovers import mounts_below, sandbox_dirs, spare_dirs
from tests.sandbox.providers.local.containment._support import run_unprivileged

pytestmark = pytest.mark.anyio

_MiB = 1 << 20


def snapshot_dirs(base: Path) -> list[str]:
    """The snapshots' directories and maker files in ``base``."""
    return sorted(name for name in os.listdir(base) if name.startswith("snap-"))


def boxes(base: Path) -> list[Path]:
    """The sandboxes' directories in ``base`` (spares not counted)."""
    return [path for path in sandbox_dirs(base) if path.name.startswith("local-")]


@pytest.fixture
async def local(sandbox_base: Path) -> AsyncIterator[LocalProvider]:
    provider = LocalProvider(base_dir=sandbox_base, memory_mib=256, disk_gib=0.25)
    yield provider
    await provider.aclose()


async def run(provider: LocalProvider, handle: SandboxHandle, command: str) -> str:
    result = await provider.exec(handle, command, timeout_s=60)
    assert result.return_code == 0, (command, result)
    return result.stdout or ""


async def tmp_space(provider: LocalProvider, handle: SandboxHandle, field: str) -> int:
    """``df``'s ``field`` (size, used) in bytes for the sandbox's /tmp: its own writable space."""
    return int((await run(provider, handle, f"df -B1 --output={field} /tmp | tail -1")).strip())


_PREPARE = "mkdir -p src/pkg && echo one > src/pkg/a && echo two > b && chmod 600 b && ln -s src/pkg/a link"


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_forks_start_as_the_snapshot_and_nothing_is_shared_after(isolation: str, sandbox_base: Path) -> None:
    provider = LocalProvider(isolation=isolation, base_dir=sandbox_base, memory_mib=256, disk_gib=0.25)
    try:
        assert isinstance(provider, SupportsSandboxSnapshot)
        parent = await provider.create(SandboxSpec())
        await run(provider, parent, _PREPARE)
        snapshot = await provider.snapshot(parent, metadata={"task": "t1"})
        assert snapshot.provider == "local" and snapshot.metadata == {"task": "t1"}
        assert snapshot.size_bytes == len("one\ntwo\n")
        await run(provider, parent, "echo later > later && echo changed > b && rm src/pkg/a")  # after the snapshot
        one = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        two = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        for fork in (one, two):
            listing = await run(provider, fork, "cat src/pkg/a b; readlink link; stat -c %a b; ls")
            assert listing == "one\ntwo\nsrc/pkg/a\n600\nb\nlink\nsrc\n"
        await run(provider, one, "echo mine > mine && echo edited > b && rm src/pkg/a && mkdir -p src/new")
        assert await run(provider, one, "cat b; ls; ls src") == "edited\nb\nlink\nmine\nsrc\nnew\npkg\n"
        assert await run(provider, two, "cat b src/pkg/a; ls; ls src") == "two\none\nb\nlink\nsrc\npkg\n"
        assert await run(provider, parent, "cat b; ls") == "changed\nb\nlater\nlink\nsrc\n"
        await provider.close(parent)  # the snapshot outlives its sandbox
        assert [s.snapshot_id for s in await provider.list_snapshots()] == [snapshot.snapshot_id]
        three = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        assert await run(provider, three, "cat b") == "two\n"
    finally:
        await provider.aclose()
    assert [name[:18] for name in snapshot_dirs(sandbox_base)] == [snapshot.snapshot_id]  # it outlives aclose too
    kept = sandbox_base / snapshot_dirs(sandbox_base)[0]  # under bwrap its layers are mounts there, read-only
    assert {Path(point).parent for point in mounts_below(sandbox_base)} <= {kept} and boxes(sandbox_base) == []


async def test_a_forks_limits_env_and_uid_are_its_own_spec(local: LocalProvider, sandbox_base: Path) -> None:
    parent = await local.create(SandboxSpec(env={"WHO": "parent"}, resources={"memory_mib": 200}))
    await run(local, parent, "head -c 1048576 /dev/zero > blob")
    snapshot = await local.snapshot(parent)
    fork = await local.create(
        SandboxSpec(env={"WHO": "fork"}, ttl_s=600, resources={"memory_mib": 128, "disk_gib": 1}),
        from_snapshot=snapshot,
    )
    assert await run(local, fork, "echo $WHO") == "fork\n"
    # Its writable space is its own tmpfs of its own disk_gib (the snapshot's files are not in it) ...
    assert await tmp_space(local, fork, "size") == 1 << 30
    assert await tmp_space(local, parent, "size") == 1 << 28
    used = await tmp_space(local, fork, "used")
    assert used < 512 * 1024  # the 1 MiB it started with costs it nothing
    await run(local, fork, "head -c 4194304 /dev/zero > more && cat blob >> more")
    assert await tmp_space(local, fork, "used") >= used + 5 * _MiB
    assert await tmp_space(local, parent, "used") < 3 * _MiB
    # ... its memory limit its own cgroup's, and its host uid its own.
    groups = CgroupBackend().groups_of(fork.sandbox_id)
    memory = [group for group in groups if (group / "memory.limit_in_bytes").exists()]
    if memory:
        assert int((memory[0] / "memory.limit_in_bytes").read_text()) == 128 * _MiB
    if os.geteuid() == 0:
        fork_root, parent_root = Path(fork.raw["root"]), Path(parent.raw["root"])
        assert (fork_root / "blob").stat().st_uid == fork_root.stat().st_uid != parent_root.stat().st_uid


async def test_a_snapshot_bigger_than_the_disk_limit_is_refused(sandbox_base: Path) -> None:
    provider = LocalProvider(base_dir=sandbox_base, memory_mib=256, disk_gib=0.004)  # about 4 MiB
    try:
        parent = await provider.create(SandboxSpec(resources={"disk_gib": 1}))
        await run(provider, parent, "mkdir big && head -c 5242880 /dev/zero > big/b && head -c 3145728 /dev/zero > c")
        big = await provider.snapshot(parent, paths=["big"])
        with pytest.raises(SandboxSnapshotError, match="disk limit"):  # a fork of 4 MiB cannot start as 5
            await provider.create(SandboxSpec(), from_snapshot=big)
        snapshot = await provider.snapshot(parent, paths=["c"])
        fork = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        await run(provider, fork, "head -c 3145728 /dev/zero > more")  # its own 4 MiB: the snapshot's are not in it
        with pytest.raises(SandboxSnapshotError, match="disk limit"):  # but 6 MiB in view is more than 4
            await provider.snapshot(fork)
        await provider.delete_snapshot(big)
        assert [s.snapshot_id for s in await provider.list_snapshots()] == [snapshot.snapshot_id]
    finally:
        await provider.aclose()
    assert [name[:18] for name in snapshot_dirs(sandbox_base)] == [snapshot.snapshot_id]  # nothing half-made left


async def test_a_snapshot_of_more_entries_than_the_disk_holds_is_refused(
    local: LocalProvider, sandbox_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Empty files take no bytes: the entries are bounded too, at the inode bound of the sandbox's tmpfs
    (65,536 for this one: lowered here), so a sandbox recreating entries under the copier cannot make
    a snapshot of more than its space holds at once."""
    monkeypatch.setattr("sandbox_middleware.providers._common._limits.entry_bound", lambda size: 40)
    parent = await local.create(SandboxSpec())
    await run(local, parent, "mkdir few many && touch few/f1 few/f2 && for i in $(seq 60); do : > many/$i; done")
    with pytest.raises(SandboxSnapshotError, match="more than 40 entries"):
        await local.snapshot(parent, paths=["many"])
    assert snapshot_dirs(sandbox_base) == []  # nothing half-made left
    kept = await local.snapshot(parent, paths=["few"])
    assert [s.snapshot_id for s in await local.list_snapshots()] == [kept.snapshot_id]
    await local.delete_snapshot(kept)


async def test_paths_choose_what_is_kept_and_never_leave_the_sandbox(local: LocalProvider, sandbox_base: Path) -> None:
    parent = await local.create(SandboxSpec(workdir="work"))
    await run(local, parent, "mkdir -p keep skip && echo k > keep/k && echo s > skip/s && ln -s / root")
    only = await local.snapshot(parent, paths=["keep", "/workspace/work/keep/k", "root"])
    fork = await local.create(SandboxSpec(workdir="work"), from_snapshot=only)
    assert await run(local, fork, "ls; cat keep/k; readlink root") == "keep\nroot\nk\n/\n"  # a link kept as a link
    assert only.size_bytes == 2  # nothing read through the link
    for hostile in (["../escape"], ["/etc/passwd"], ["root/etc/passwd"], ["keep/../../x"]):
        with pytest.raises(SandboxPathError):
            await local.snapshot(parent, paths=hostile)
    with pytest.raises(SandboxSnapshotError, match="does not exist"):
        await local.snapshot(parent, paths=["missing"])
    with pytest.raises(SandboxSnapshotError, match="not a directory"):
        await local.snapshot(parent, paths=["keep/k/under"])
    assert [s.snapshot_id for s in await local.list_snapshots()] == [only.snapshot_id]
    assert [name[:18] for name in snapshot_dirs(sandbox_base)] == [only.snapshot_id]  # nothing half-made left


async def test_hostile_other_and_deleted_snapshots_are_not_found(
    local: LocalProvider, sandbox_base: Path, tmp_path: Path
) -> None:
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "file").write_text("keep me")
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo x > x")
    snapshot = await local.snapshot(parent, metadata={"run": "mine"})
    forged = [
        dataclasses.replace(snapshot, snapshot_id=name)
        for name in ("../../" + decoy.name, str(decoy), "snap-\x00", "snap-0000000000000", f"{snapshot.snapshot_id}/..")
    ]
    forged += [
        dataclasses.replace(snapshot, provider="docker"),  # another provider's
        dataclasses.replace(snapshot, metadata={"run": "other"}),  # another run's
        dataclasses.replace(snapshot, size_bytes=10**9),
    ]
    for bad in forged:
        with pytest.raises(SandboxSnapshotNotFoundError):
            await local.create(SandboxSpec(), from_snapshot=bad)
        with pytest.raises(SandboxSnapshotNotFoundError):
            await local.delete_snapshot(bad)
    await local.delete_snapshot(snapshot)
    for action in (local.delete_snapshot(snapshot), local.create(SandboxSpec(), from_snapshot=snapshot)):
        with pytest.raises(SandboxSnapshotNotFoundError, match="deleted"):
            await action
    assert (decoy / "file").read_text() == "keep me" and await local.list_snapshots() == []
    assert snapshot_dirs(sandbox_base) == []


async def test_a_descriptor_works_from_another_provider_on_the_same_base_dir(
    local: LocalProvider, sandbox_base: Path
) -> None:
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo shared > f")
    snapshot = await local.snapshot(parent, metadata={"run": "r1"})
    other = LocalProvider(base_dir=sandbox_base, memory_mib=256, disk_gib=0.25, prestart=False)
    try:
        assert await other.list_snapshots(metadata={"run": "r1"}) == [snapshot]
        assert await other.list_snapshots(metadata={"run": "r2"}) == []
        for descriptor in (
            pickle.loads(pickle.dumps(snapshot)),
            SandboxSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))),
        ):
            fork = await other.create(SandboxSpec(), from_snapshot=descriptor)
            assert await run(other, fork, "cat f") == "shared\n"
            await other.close(fork)
        await other.delete_snapshot(SandboxSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))))
        assert await local.list_snapshots() == []
        with pytest.raises(SandboxSnapshotNotFoundError):
            await local.create(SandboxSpec(), from_snapshot=snapshot)
    finally:
        await other.aclose()


async def test_a_deleted_snapshot_stays_for_its_forks_until_the_last_one_closes(
    local: LocalProvider, sandbox_base: Path
) -> None:
    parent = await local.create(SandboxSpec())
    await run(local, parent, "mkdir d && echo kept > d/f")
    snapshot = await local.snapshot(parent)
    forks = [await local.create(SandboxSpec(), from_snapshot=snapshot) for _ in range(2)]
    await local.delete_snapshot(snapshot)
    assert await local.list_snapshots() == [] and len(snapshot_dirs(sandbox_base)) == 1
    for fork in forks:
        assert await run(local, fork, "cat d/f; echo new > d/g; cat d/g") == "kept\nnew\n"
    await local.close(forks[0])
    assert len(snapshot_dirs(sandbox_base)) == 1
    assert await run(local, forks[1], "cat d/f") == "kept\n"
    await local.close(forks[1])
    assert snapshot_dirs(sandbox_base) == []


async def test_a_fork_takes_a_spare_and_the_next_plain_create_starts_empty(
    local: LocalProvider, sandbox_base: Path
) -> None:
    """A spare made before the snapshot existed becomes a fork: the snapshot's files are mounted on its
    files while it runs (its view, and its commands' made ahead, show them); the spare made after it
    holds nothing of the snapshot's."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo x > x")
    snapshot = await local.snapshot(parent)
    with anyio.fail_after(60):
        while len(spare_dirs(sandbox_base)) != 1:
            await anyio.sleep(0.01)
    [spare] = spare_dirs(sandbox_base)
    fork = await local.create(SandboxSpec(), from_snapshot=snapshot)
    assert spare.name.startswith(fork.sandbox_id + "-")
    assert await run(local, fork, "cat x; echo mine > y; ls") == "x\nx\ny\n"
    with anyio.fail_after(60):
        while len(spare_dirs(sandbox_base)) != 1:
            await anyio.sleep(0.01)
    plain = await local.create(SandboxSpec())  # the next spare
    assert await run(local, plain, "ls -A") == ""
    assert await run(local, parent, "ls") == "x\n"


async def test_fork_on_the_facade(local: LocalProvider, sandbox_base: Path) -> None:
    async with Sandbox(local, SandboxSpec(workdir="/workspace")) as parent:
        await parent.exec("echo prepared > state")
        async with parent.fork(3) as forks:
            outputs = [(await fork.exec("cat state; echo $$ > me; ls")).stdout for fork in forks]
            assert outputs == ["prepared\nme\nstate\n"] * 3
        assert await local.list_snapshots() == [] and snapshot_dirs(sandbox_base) == []
    assert await local.list() == []  # every fork closed (the next spare may be under way)


_CHILD = """
import anyio, os, signal, sys
from sandbox_middleware import LocalProvider, SandboxSpec
from sandbox_middleware.providers.local import _layers, _snapshots

provider = LocalProvider(base_dir=sys.argv[1], prestart=False)
step = sys.argv[2]  # what the process is killed after: a copy's files, or a layer of a snapshot without a copy
module = _snapshots if step == "copy_names" else _layers
real = getattr(module, step)

def killed(*args, **kwargs):
    real(*args, **kwargs)
    print("made", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

setattr(module, step, killed)

async def main():
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "echo x > x")
    await provider.snapshot(handle, paths=["x"] if step == "copy_names" else None)

anyio.run(main)
"""


@pytest.mark.requires_bwrap  # the snapshot is made in a subprocess (its LocalProvider's default isolation)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one backend is enough for a process killed on purpose
@pytest.mark.parametrize("step", ["copy_names", "clone_readonly"])
async def test_a_snapshot_half_made_by_a_killed_process_is_swept(step: str, sandbox_base: Path) -> None:
    """Killed while copying, or with the sandbox frozen and a layer mounted in the snapshot's directory:
    the next provider's sweep removes the snapshot (its mounts too); the sandbox, thawed, is closed."""
    sandbox_base.mkdir(parents=True)
    async with await anyio.open_process([sys.executable, "-c", _CHILD, str(sandbox_base), step]) as child:
        with anyio.fail_after(60):
            assert child.stdout is not None
            assert (await child.stdout.receive()).strip() == b"made"
            await child.wait()
    assert child.returncode == -signal.SIGKILL
    assert len(snapshot_dirs(sandbox_base)) == 2  # its directory and its maker file
    provider = LocalProvider(base_dir=sandbox_base, prestart=False)  # sweeps
    try:
        assert snapshot_dirs(sandbox_base) == [] and await provider.list_snapshots() == []
    finally:
        for listing in await provider.list():  # the dead process's sandbox, whole: reap's to close
            await provider.close(listing.handle)
        await provider.aclose()
    assert mounts_below(sandbox_base) == [] and sandbox_dirs(sandbox_base) == []


_FORKER = """
import anyio, json, sys
from sandbox_middleware import LocalProvider, SandboxSnapshot, SandboxSpec

async def main():
    provider = LocalProvider(base_dir=sys.argv[1], prestart=False)
    fork = await provider.create(SandboxSpec(), from_snapshot=SandboxSnapshot.from_dict(json.loads(sys.argv[2])))
    print((await provider.exec(fork, "cat f")).stdout.strip(), flush=True)
    await anyio.sleep(600)

anyio.run(main)
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one backend is enough for a process killed on purpose
async def test_a_fork_in_another_process_keeps_a_deleted_snapshot_until_it_is_closed(
    local: LocalProvider, sandbox_base: Path
) -> None:
    """A descriptor (JSON) used in another process; that process is SIGKILLed with its fork alive: the
    snapshot deleted here stays for that fork, whose close (a listed handle, as reap closes it) removes it."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo from-parent > f")
    snapshot = await local.snapshot(parent)
    argv = [sys.executable, "-c", _FORKER, str(sandbox_base), json.dumps(snapshot.to_dict())]
    async with await anyio.open_process(argv) as child:
        try:
            assert child.stdout is not None
            with anyio.fail_after(60):
                assert (await child.stdout.receive()).strip() == b"from-parent"
        finally:
            child.send_signal(signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await child.wait()
    await local.delete_snapshot(snapshot)
    assert await local.list_snapshots() == [] and len(snapshot_dirs(sandbox_base)) == 1
    LocalProvider(base_dir=sandbox_base, prestart=False)  # its sweep leaves it: a fork names it
    assert len(snapshot_dirs(sandbox_base)) == 1
    [orphan] = [listing.handle for listing in await local.list() if listing.handle.sandbox_id != parent.sandbox_id]
    await local.close(orphan)
    assert snapshot_dirs(sandbox_base) == []


_UNPRIVILEGED = """
import anyio, json, os, sys
from sandbox_middleware import LocalProvider, SandboxSpec

async def main():
    provider = LocalProvider(isolation="none", base_dir=os.path.join(sys.argv[1], "boxes"))
    parent = await provider.create(SandboxSpec())
    await provider.exec(parent, "mkdir d && echo one > d/f && ln -s d/f link")
    snapshot = await provider.snapshot(parent)
    fork = await provider.create(SandboxSpec(), from_snapshot=snapshot)
    seen = (await provider.exec(fork, "cat d/f; readlink link; echo two > d/f; echo new > n")).stdout
    after = (await provider.exec(parent, "cat d/f; ls")).stdout
    await provider.delete_snapshot(snapshot)
    await provider.aclose()
    print(json.dumps({"seen": seen, "after": after, "left": sorted(os.listdir(os.path.join(sys.argv[1], "boxes")))}))

anyio.run(main)
"""


def test_without_the_right_to_mount_a_fork_starts_as_a_copy(sandbox_base: Path) -> None:
    """As a user who may not mount (no overlay), a fork's files are a copy of the snapshot's: as isolated."""
    result = run_unprivileged(_UNPRIVILEGED, sandbox_base)
    assert result == {"seen": "one\nd/f\n", "after": "one\nd\nlink\n", "left": []}
