"""LocalProvider's snapshots without a copy and its forks (``_layers.py``), under real bwrap: a sandbox's
files frozen in place as read-only layers, the parent going on in a space of its own; a copy where a
command or an upload runs; nothing a command does uncovers a layer; a lost layer, a killed maker, two
providers at once; a later snapshot counts only what changed, exactly."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from sandbox_middleware import LocalProvider, SandboxHandle, SandboxSnapshotNotFoundError, SandboxSpec
from sandbox_middleware.providers.local import _layers, _transfers
from sandbox_middleware.providers.local._mounts import mount_overlay, unmount
from tests.leftovers import mounts_below, sandbox_dirs
from tests.sandbox.providers.local.test_snapshots import run, snapshot_dirs

pytestmark = [
    pytest.mark.anyio,
    # Without root the provider may not mount: every snapshot is a copy (test_snapshots.py covers that).
    pytest.mark.skipif(os.geteuid() != 0, reason="snapshots without a copy mount: run these tests as root"),
]


@pytest.fixture
async def local(sandbox_base: Path) -> AsyncIterator[LocalProvider]:
    provider = LocalProvider(base_dir=sandbox_base, memory_mib=256, disk_gib=0.25)
    yield provider
    await provider.aclose()


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

    monkeypatch.setattr(_layers, "mount_overlay", slowed)
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
from sandbox_middleware.providers.local import _layers

def hang(*args):
    print("frozen", flush=True)
    time.sleep(600)

async def main():
    provider = LocalProvider(base_dir=sys.argv[1], memory_mib=256, disk_gib=0.25, prestart=False)
    handle = await provider.create(SandboxSpec())
    Path(sys.argv[2]).write_text(json.dumps([handle.sandbox_id]))
    _layers.clone_readonly = hang
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
