"""LocalProvider's snapshots and forks (``_snapshots.py``), under real bwrap: forks start as the snapshot,
are isolated from each other and from the parent both ways, keep their own spec's limits; hostile paths,
ids and deleted snapshots are typed errors; a descriptor works from another provider on the same base_dir;
a deleted snapshot outlives its last fork only; a half-made one is swept."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import sys
import threading
import time
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
from sandbox_middleware.providers.local import _snapshots, _transfers
from sandbox_middleware.providers.local._cgroups import CgroupBackend
from sandbox_middleware.providers.local._mounts import mount_overlay, unmount
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
    monkeypatch.setattr("sandbox_middleware.providers.local._snapshots.entry_bound", lambda size: 40)
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
from sandbox_middleware.providers.local import _snapshots

provider = LocalProvider(base_dir=sys.argv[1], prestart=False)
step = sys.argv[2]  # what the process is killed after: a copy's files, or a layer of a snapshot without a copy
real = getattr(_snapshots, step)

def killed(*args, **kwargs):
    real(*args, **kwargs)
    print("made", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

setattr(_snapshots, step, killed)

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


# --- a snapshot of the whole working directory under bwrap: no copy (``_snapshots.rotate``) -------------


def layer_mounts(base: Path) -> list[str]:
    """The snapshots' layers mounted in ``base`` (read-only mounts in their directories)."""
    return [point for point in mounts_below(base) if Path(point).parent.name.startswith("snap-")]


async def test_a_snapshot_freezes_the_files_in_place_and_the_parent_goes_on_with_a_space_of_its_own(
    sandbox_base: Path,
) -> None:
    """No copy: the parent's files become the snapshot's read-only layer; the parent writes on in a new
    tmpfs of its disk_gib, so it keeps its whole writable space; a fork sees what it saw then."""
    provider = LocalProvider(base_dir=sandbox_base, memory_mib=256, disk_gib=0.05)  # about 53 MB
    try:
        parent = await provider.create(SandboxSpec())
        await run(provider, parent, "head -c 40000000 /dev/zero > first && echo one > a")
        snapshot = await provider.snapshot(parent)
        assert snapshot.size_bytes == 40_000_004
        [layer] = layer_mounts(sandbox_base)
        assert os.statvfs(layer).f_flag & os.ST_RDONLY  # read-only, for this process too
        with pytest.raises(OSError):
            (Path(layer) / "written-after").write_text("x")
        # 40 MB more fits (it did not before: 80 MB > 53 MB): the parent's new space is its own.
        await run(provider, parent, "head -c 40000000 /dev/zero > second && echo changed > a && rm first")
        assert await run(provider, parent, "cat a; ls") == "changed\na\nsecond\n"
        fork = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        assert await run(provider, fork, "cat a; ls; stat -c %s first") == "one\na\nfirst\n40000000\n"
        second = await provider.snapshot(parent)  # of the parent's files now: both layers, the top one first
        assert len(layer_mounts(sandbox_base)) == 1 + 2
        again = await provider.create(SandboxSpec(), from_snapshot=second)
        assert await run(provider, again, "cat a; ls") == "changed\na\nsecond\n"
        for handle in (fork, again, parent):
            await provider.close(handle)
        for kept in (snapshot, second):
            await provider.delete_snapshot(kept)
    finally:
        await provider.aclose()
    assert mounts_below(sandbox_base) == [] and sandbox_dirs(sandbox_base) == []


async def test_a_snapshot_while_a_command_runs_is_a_copy_and_the_command_runs_on(local: LocalProvider) -> None:
    """A running command could write where the layer would be frozen: the snapshot is then a copy, taken
    while it runs, and the command is not disturbed (its sandbox is thawed before the copy)."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo before > a")
    async with anyio.create_task_group() as group:
        done: list[str] = []

        async def long() -> None:
            done.append(await run(local, parent, "sleep 1; echo during > b; cat a"))

        group.start_soon(long)
        await anyio.sleep(0.5)
        snapshot = await local.snapshot(parent)
        assert layer_mounts(local._base) == []  # a copy: its tree, no layer
    assert done == ["before\n"]
    fork = await local.create(SandboxSpec(), from_snapshot=snapshot)
    assert await run(local, fork, "cat a; ls") == "before\na\n"
    assert await run(local, parent, "cat b") == "during\n"


async def test_closing_the_parent_frees_its_tmp_and_keeps_the_snapshot(
    local: LocalProvider, sandbox_base: Path
) -> None:
    """The snapshot holds the parent's tmpfs; the parent's /tmp and /dev/shm go when it closes, so only
    the snapshot's files stay held."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "head -c 20000000 /dev/zero > /tmp/scratch && head -c 30000000 /dev/zero > /dev/shm/s")
    await run(local, parent, "echo kept > a")
    snapshot = await local.snapshot(parent)
    [layer] = layer_mounts(sandbox_base)
    info = os.statvfs(layer)
    assert (info.f_blocks - info.f_bfree) * info.f_frsize >= 50_000_000
    await local.close(parent)
    info = os.statvfs(layer)
    assert (info.f_blocks - info.f_bfree) * info.f_frsize < 1_000_000
    fork = await local.create(SandboxSpec(), from_snapshot=snapshot)
    assert await run(local, fork, "cat a; ls -A /tmp /dev/shm") == "kept\n/dev/shm:\n\n/tmp:\n"


async def test_a_command_cannot_uncover_the_frozen_layer(local: LocalProvider, sandbox_base: Path) -> None:
    """Under the parent's new files lies the frozen layer: a command can neither unmount what covers it
    (no capability; the mount is locked) nor reach it by a namespace of its own, so no fork sees a change."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo one > a")
    snapshot = await local.snapshot(parent)
    for attempt in ("umount /workspace", "umount -l /workspace", "unshare -rm sh -c 'umount /workspace'"):
        result = await local.exec(parent, f"{attempt} && echo two > a")
        assert result.return_code != 0, (attempt, result)
    await run(local, parent, "echo parent > a")
    fork = await local.create(SandboxSpec(), from_snapshot=snapshot)
    assert await run(local, fork, "cat a") == "one\n"
    assert (Path(layer_mounts(sandbox_base)[0]) / "a").read_text() == "one\n"


async def test_a_snapshot_whose_layers_are_gone_is_not_found(local: LocalProvider, sandbox_base: Path) -> None:
    """A snapshot without a copy lives in memory: after a reboot (here: its layer unmounted) its record
    is there but its files are not, and a fork of it is refused, typed, instead of starting empty."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "echo one > a")
    snapshot = await local.snapshot(parent)
    [layer] = layer_mounts(sandbox_base)
    unmount(Path(layer))
    with pytest.raises(SandboxSnapshotNotFoundError, match="kept in memory, are gone"):
        await local.create(SandboxSpec(), from_snapshot=snapshot)
    await local.delete_snapshot(snapshot)
    assert snapshot_dirs(sandbox_base) == []


# --- what an attacker's review found (each failed before its fix) -------------------------------------


def _provider(base: Path, **options: object) -> LocalProvider:
    return LocalProvider(base_dir=base, memory_mib=256, disk_gib=0.25, **options)  # type: ignore[arg-type]


async def test_an_upload_in_flight_does_not_write_into_a_snapshot_after_it_returned(
    sandbox_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload holds its target open on box/ from a provider thread (which no freezer stops): a snapshot
    meanwhile is a copy, so nothing the upload writes after snapshot() returned lands in a layer."""
    started, resume = threading.Event(), threading.Event()

    def paused(source_fd: int, target_fd: int, limit: int | None) -> int:
        os.write(target_fd, b"before ")
        started.set()
        resume.wait(30)
        os.write(target_fd, b"after")
        return 12

    monkeypatch.setattr(_transfers, "_copy", paused)
    source = tmp_path / "source"
    source.write_bytes(b"")
    provider = _provider(sandbox_base)
    try:
        parent = await provider.create(SandboxSpec())
        async with anyio.create_task_group() as group:
            group.start_soon(provider.upload_file, parent, source, "/workspace/f")
            await anyio.to_thread.run_sync(started.wait, 30)
            snapshot = await provider.snapshot(parent)
            assert layer_mounts(sandbox_base) == []  # a copy
            resume.set()
        fork = await provider.create(SandboxSpec(), from_snapshot=snapshot)
        assert (await provider.exec(fork, "cat f")).stdout in ("", "before ")  # as of the snapshot
        await provider.delete_snapshot(snapshot)
    finally:
        resume.set()
        await provider.aclose()


async def test_two_providers_snapshotting_at_once_freeze_the_sandbox_for_both(
    sandbox_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two providers (processes) snapshotting one sandbox at once: one freezes its files, the other copies
    (the sandbox's lock), so neither thaws it under the other, and a command started right after writes
    into the parent's new files, not into the layer a fork sees. (The first rotation is slowed.)"""
    calls: list[None] = []

    def slowed(*args: object) -> None:
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.3)
        mount_overlay(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_snapshots, "mount_overlay", slowed)
    key = os.urandom(32)
    first, second = _provider(sandbox_base, connect_key=key), _provider(sandbox_base, connect_key=key)
    try:
        handle = await first.create(SandboxSpec())
        await first.exec(handle, "echo before > f")
        other = await second.connect(await first.serialize_handle(handle))
        taken = []

        async def take() -> None:
            taken.append(await second.snapshot(other))

        async with anyio.create_task_group() as group:
            group.start_soon(take)
            await anyio.sleep(0.1)
            await first.snapshot(handle)
            await first.exec(handle, "exec 3>>f; sleep 0.6; echo late >&3")
        fork = await second.create(SandboxSpec(), from_snapshot=taken[0])
        assert (await second.exec(fork, "cat f")).stdout == "before\n"
        for snapshot in await first.list_snapshots():
            await first.delete_snapshot(snapshot)
    finally:
        await second.aclose()
        await first.aclose()


_KILLED = """
import anyio, json, os, signal, sys, time
from pathlib import Path
from sandbox_middleware import LocalProvider, SandboxSpec
from sandbox_middleware.providers.local import _snapshots

def hang(*args):
    print("frozen", flush=True)
    time.sleep(600)

async def main():
    provider = LocalProvider(base_dir=sys.argv[1], memory_mib=256, disk_gib=0.25, prestart=False)
    handle = await provider.create(SandboxSpec())
    Path(sys.argv[2]).write_text(json.dumps([handle.sandbox_id]))
    _snapshots.clone_readonly = hang
    await provider.snapshot(handle)

anyio.run(main)
"""


@pytest.mark.requires_bwrap
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one backend is enough for a process killed on purpose
async def test_a_provider_killed_mid_rotation_leaves_no_sandbox_frozen(sandbox_base: Path, tmp_path: Path) -> None:
    """Killed with the sandbox frozen: the next provider's sweep removes the half-made snapshot and thaws
    the sandbox (what the killed process mounted undone), whose commands then run."""
    sandbox_base.mkdir(parents=True)
    ids = tmp_path / "ids.json"
    async with await anyio.open_process([sys.executable, "-c", _KILLED, str(sandbox_base), str(ids)]) as child:
        with anyio.fail_after(60):
            assert child.stdout is not None
            assert (await child.stdout.receive()).strip() == b"frozen"
        child.send_signal(signal.SIGKILL)
        await child.wait()
    [sandbox_id] = json.loads(ids.read_text())
    provider = _provider(sandbox_base, prestart=False)  # sweeps
    try:
        groups = [group for group in provider._cgroups.groups_of(sandbox_id) if (group / "freezer.state").exists()]  # type: ignore[union-attr]
        assert groups and [(group / "freezer.state").read_text().strip() for group in groups] == ["THAWED"]
        assert snapshot_dirs(sandbox_base) == [] and layer_mounts(sandbox_base) == []
    finally:
        for listing in await provider.list():
            await provider.close(listing.handle)
        await provider.aclose()
    assert mounts_below(sandbox_base) == [] and sandbox_dirs(sandbox_base) == []


async def test_a_rotated_fork_of_a_copied_snapshot_can_be_forked(sandbox_base: Path) -> None:
    """A fork of a copied snapshot (paths=) has the copy's tree/ (base_dir's disk) as its layer, which its
    own snapshot cannot freeze (the copy's tree is removed with its snapshot): that snapshot is a copy,
    which outlives the copied one."""
    provider = _provider(sandbox_base)
    try:
        parent = await provider.create(SandboxSpec())
        await provider.exec(parent, "echo one > a")
        copied = await provider.snapshot(parent, paths=["a"])
        fork = await provider.create(SandboxSpec(), from_snapshot=copied)
        rotated = await provider.snapshot(fork)
        await provider.close(fork)
        await provider.delete_snapshot(copied)
        again = await provider.create(SandboxSpec(), from_snapshot=rotated)
        assert (await provider.exec(again, "cat a")).stdout == "one\n"
        await provider.delete_snapshot(rotated)
    finally:
        await provider.aclose()


_SIZES = "find . -type f -printf '%s\\n' | awk '{s += $1} END {print s + 0}'; find . -mindepth 1 | wc -l"


async def test_a_later_snapshots_size_counts_only_what_changed_and_is_still_exact(local: LocalProvider) -> None:
    """A snapshot counts the files a fork will see (``size_bytes``, and the entries its disk bounds); a
    later one of the same files walks only the directories written since (their counts kept from the
    last): still exactly what ``find`` counts inside, whatever the sandbox did in between (appends,
    truncations, a directory removed or renamed, new ones), for the parent and for a fork's own."""
    parent = await local.create(SandboxSpec())
    await run(local, parent, "mkdir -p a/b c d && seq 1000 > a/b/f && seq 10 > c/g && seq 5 > d/h && echo x > top")

    async def counted(handle: SandboxHandle) -> tuple[int, int]:
        size, entries = (await run(local, handle, _SIZES)).split()
        return int(size), int(entries)

    first = await local.snapshot(parent)
    assert first.size_bytes == (await counted(parent))[0]
    changes = [
        "seq 2000 >> a/b/f",
        "rm -r c",
        "mv d e && seq 7 > e/i",
        "truncate -s 3 top && mkdir -p n/m && seq 99 > n/m/j",
        "",  # nothing changed
    ]
    for change in changes:
        if change:
            await run(local, parent, change)
        later = await local.snapshot(parent)
        assert later.size_bytes == (await counted(parent))[0], change
    fork = await local.create(SandboxSpec(), from_snapshot=later)
    await run(local, fork, "seq 50 > a/new && rm -r e")
    own = await local.snapshot(fork)
    assert own.size_bytes == (await counted(fork))[0]
    again = await local.create(SandboxSpec(), from_snapshot=own)
    assert await counted(again) == await counted(fork)
