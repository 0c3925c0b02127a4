"""Ownership and reaping: sandboxes of crashed owners and finished runs are found and closed, nothing else."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    LocalProvider,
    Middleware,
    OwnershipMiddleware,
    ReleaseAccountingMiddleware,
    SandboxError,
    SandboxSpec,
    reap,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider
from tests.providers import PlainProvider, crashed_worker, dead_owner_stamp, in_own_pid_namespace, live_worker

pytestmark = pytest.mark.anyio

_WORKER = """
import anyio, sys
from sandbox_middleware import LocalProvider, Middleware, OwnershipMiddleware, SandboxSpec, stack

async def main():
    disk = {"disk_gib": None} if sys.argv[3:] == ["unbounded"] else {}
    provider = stack(LocalProvider(isolation="none", base_dir=sys.argv[1], **disk),
                     [Middleware(OwnershipMiddleware, run_id=sys.argv[2])])
    for _ in range(3):
        handle = await provider.create(SandboxSpec())
        await provider.exec(handle, "sleep 300 > /dev/null 2>&1 &")
        print(handle.sandbox_id, flush=True)
    await anyio.sleep(600)

anyio.run(main)
"""


@pytest.fixture
async def local(tmp_path: Path, sandbox_base: Path) -> AsyncIterator[LocalProvider]:
    provider = LocalProvider(isolation="none", base_dir=sandbox_base)
    yield provider
    await provider.aclose()


async def test_reap_closes_exactly_what_a_killed_worker_held(
    local: LocalProvider, tmp_path: Path, sandbox_base: Path
) -> None:
    """After SIGKILL, reap closes the dead worker's sandboxes and none of a live run's."""
    crashed = await crashed_worker([sys.executable, "-c", _WORKER, str(sandbox_base), "crashed-run"])
    live = stack(local, [Middleware(OwnershipMiddleware, run_id="live-run")])
    mine = await live.create(SandboxSpec())
    unowned = await local.create(SandboxSpec())
    truth = {
        listing.handle.sandbox_id for listing in await local.list(metadata={"sandbox_middleware.run_id": "crashed-run"})
    }
    assert truth == crashed

    preview = await reap(local, dry_run=True)
    assert {entry.sandbox_id for entry in preview} == crashed
    assert not any(entry.closed for entry in preview)
    assert all("no longer alive" in entry.reason for entry in preview)

    reaped = await reap(local)
    assert {entry.sandbox_id for entry in reaped} == crashed
    assert all(entry.closed and entry.error is None for entry in reaped)
    remaining = {listing.handle.sandbox_id for listing in await local.list()}
    assert remaining == {mine.sandbox_id, unowned.sandbox_id}
    assert not [path for path in sandbox_base.iterdir() if path.name[:18] in crashed]


async def test_a_trainer_in_its_own_pid_namespace_is_of_unknown_liveness_here(
    local: LocalProvider, sandbox_base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer with the host's hostname in a PID namespace of its own (a host-network container): its
    pid means nothing here (it is 1 there; 1 here is init, started at another time), so reap, from the
    host, with or without its run id, leaves its sandboxes alone and reports them as of unknown
    liveness; only force takes them. It took them as of a dead owner: the hostname was the same.
    (Its sandboxes have no tmpfs of their own: mounts made in its private mount namespace would hide
    their records from the host, as a container's do; its PID namespace is what this is about.)"""
    argv = in_own_pid_namespace([sys.executable, "-c", _WORKER, str(sandbox_base), "ns-run", "unbounded"])
    async with live_worker(argv) as made:
        listed = await local.list(metadata={"sandbox_middleware.run_id": "ns-run"})
        assert {listing.handle.sandbox_id for listing in listed} == made
        stamp = listed[0].metadata
        assert stamp["sandbox_middleware.owner.host"] == os.uname().nodename
        assert stamp["sandbox_middleware.owner.pidns"] != os.readlink("/proc/self/ns/pid")
        assert stamp["sandbox_middleware.owner.pid"] == "1"  # the namespace's first process
        for report in (await reap(local), await reap(local, run_id="ns-run"), await reap(local, dry_run=True)):
            assert report == []
            assert {entry.sandbox_id for entry in report.unknown} == made
            assert all("PID namespace" in entry.reason and entry.run_id == "ns-run" for entry in report.unknown)
        assert "left 3 sandbox(es) alone, their owners' liveness unknown here" in caplog.text
        assert {listing.handle.sandbox_id for listing in await local.list()} == made
        forced = await reap(local, run_id="ns-run", force=True)
        assert {entry.sandbox_id for entry in forced} == made and all(entry.closed for entry in forced)
        assert forced.unknown == ()
        assert await local.list() == []
        assert not [path for path in sandbox_base.iterdir() if path.name[:18] in made]


async def test_reap_by_run_spares_live_owners_unless_forced(local: LocalProvider) -> None:
    """reap(run_id=...) leaves a live owner's sandboxes alone; force=True takes them; other runs never."""
    run = stack(local, [Middleware(OwnershipMiddleware, run_id="run-1")])
    other = stack(local, [Middleware(OwnershipMiddleware, run_id="run-2")])
    first, second = await run.create(SandboxSpec()), await other.create(SandboxSpec())
    assert await reap(local, run_id="run-1") == []
    forced = await reap(local, run_id="run-1", force=True)
    assert [entry.sandbox_id for entry in forced] == [first.sandbox_id]
    assert [listing.handle.sandbox_id for listing in await local.list()] == [second.sandbox_id]


async def test_ownership_stamps_metadata_and_ttl(local: LocalProvider) -> None:
    """The stamp names the run and this process; the spec's own metadata and TTL are kept."""
    layer = OwnershipMiddleware(local, run_id="r", ttl_s=900)
    await layer.create(SandboxSpec(metadata={"task": "t1"}))
    await layer.create(SandboxSpec(ttl_s=5))
    listings = sorted(
        await local.list(metadata={"sandbox_middleware.run_id": "r"}), key=lambda item: item.created_at or 0
    )
    first, _second = listings
    assert first.metadata["task"] == "t1"
    assert first.metadata["sandbox_middleware.owner.pid"] == str(os.getpid())
    ttls = [local._boxes[item.handle.sandbox_id].deadline for item in listings]
    assert ttls[0] is not None and ttls[1] is not None and ttls[0] > ttls[1]
    assert OwnershipMiddleware(local).run_id != OwnershipMiddleware(local).run_id


async def test_lost_create_responses_are_reaped_with_the_run(local: LocalProvider) -> None:
    """Sandboxes whose create response was lost are held by no ledger; the run's reap finds and closes them."""
    faulty = FaultInjectingProvider(local, lost_create_rate=0.5, seed=3)
    provider = stack(faulty, [Middleware(OwnershipMiddleware, run_id="lossy")])
    held = []
    for _ in range(20):
        with contextlib.suppress(SandboxError):
            held.append(await provider.create(SandboxSpec()))
    assert faulty.orphaned, "the seed should lose some responses"
    for handle in held:
        await provider.close(handle)
    reaped = await reap(local, run_id="lossy", force=True)
    assert {entry.sandbox_id for entry in reaped} == set(faulty.orphaned)
    assert await local.list() == []


async def test_reap_needs_a_listing_provider() -> None:
    """A provider that cannot list is a clear error, not a silent no-op."""
    with pytest.raises(SandboxError, match="cannot list its sandboxes"):
        await reap(PlainProvider())


async def test_release_accounting_reports_lost_create_responses_as_orphans(local: LocalProvider) -> None:
    """Sandboxes this process's run made but whose create response was lost are the ledger's orphans."""
    faulty = FaultInjectingProvider(local, lost_create_rate=0.5, seed=5)
    ownership = OwnershipMiddleware(faulty, run_id="orphans")
    accounting = ReleaseAccountingMiddleware(ownership)
    held = []
    for _ in range(16):
        with contextlib.suppress(SandboxError):
            held.append(await accounting.create(SandboxSpec()))
    other_run = await OwnershipMiddleware(local, run_id="other").create(SandboxSpec())
    orphans = await accounting.orphans(ownership.stamp)
    assert {listing.handle.sandbox_id for listing in orphans} == set(faulty.orphaned)
    assert other_run.sandbox_id not in {listing.handle.sandbox_id for listing in orphans}
    reaped = await reap(local, run_id="orphans", force=True)
    assert {entry.sandbox_id for entry in reaped} == set(faulty.orphaned) | {handle.sandbox_id for handle in held}


async def test_orphans_need_a_listing_provider() -> None:
    with pytest.raises(SandboxError, match="cannot list its sandboxes"):
        await ReleaseAccountingMiddleware(PlainProvider()).orphans({})


# -- snapshots, reaped like sandboxes ----------------------------------------------------------------


async def test_reap_deletes_the_snapshots_of_dead_owners_and_expired_ones() -> None:
    """A crashed run's snapshots (its owner dead) and any past its expiry are deleted and reported as
    snapshots; a live run's, an unstamped one and one of an owner of unknown liveness are left, the
    last reported in ``unknown``. dry_run deletes nothing."""
    memory = FaultInjectingProvider()
    crashed = {"sandbox_middleware.run_id": "crashed", **dead_owner_stamp()}
    elsewhere = {**crashed, "sandbox_middleware.owner.host": "another-host"}
    parent = await memory.create(SandboxSpec())
    dead_sandbox = await memory.create(SandboxSpec(metadata=crashed))
    dead = {(await memory.snapshot(parent, metadata=crashed)).snapshot_id for _ in range(2)}
    unsure = await memory.snapshot(parent, metadata=elsewhere)
    live = OwnershipMiddleware(memory, run_id="live")
    kept = await live.snapshot(parent)
    unstamped = await memory.snapshot(parent)
    short = OwnershipMiddleware(memory, run_id="live", ttl_s=0.01)
    expiring = await short.snapshot(parent)
    await anyio.sleep(0.05)

    preview = await reap(memory, dry_run=True)
    assert {(entry.kind, entry.sandbox_id) for entry in preview} == {
        ("sandbox", dead_sandbox.sandbox_id),
        *(("snapshot", snapshot_id) for snapshot_id in dead | {expiring.snapshot_id}),
    }
    assert not any(entry.closed for entry in preview) and len(await memory.list_snapshots()) == 6
    assert [(entry.kind, entry.sandbox_id) for entry in preview.unknown] == [("snapshot", unsure.snapshot_id)]
    assert "another host" in preview.unknown[0].reason

    reaped = await reap(memory)
    snapshots = {entry.sandbox_id: entry for entry in reaped if entry.kind == "snapshot"}
    assert set(snapshots) == dead | {expiring.snapshot_id} and all(entry.closed for entry in snapshots.values())
    assert "no longer alive" in snapshots[min(dead)].reason and snapshots[min(dead)].run_id == "crashed"
    assert "expired" in snapshots[expiring.snapshot_id].reason and snapshots[expiring.snapshot_id].run_id == "live"
    left = {snapshot.snapshot_id for snapshot in await memory.list_snapshots()}
    assert (
        left
        == {unsure.snapshot_id, kept.snapshot_id, unstamped.snapshot_id}
        == memory.snapshots - dead - {expiring.snapshot_id}
    )


async def test_reap_by_run_takes_that_runs_snapshots_and_force_takes_a_live_runs() -> None:
    memory = FaultInjectingProvider()
    parent = await memory.create(SandboxSpec())
    crashed = {"sandbox_middleware.run_id": "crashed", **dead_owner_stamp()}
    finished = await memory.snapshot(parent, metadata=crashed)
    other_run = await memory.snapshot(parent, metadata={**crashed, "sandbox_middleware.run_id": "other"})
    live = await OwnershipMiddleware(memory, run_id="live").snapshot(parent)
    reaped = await reap(memory, run_id="crashed")
    assert [(entry.kind, entry.sandbox_id, entry.closed) for entry in reaped] == [
        ("snapshot", finished.snapshot_id, True)
    ]
    assert reaped[0].reason.startswith("run crashed finished; owner")
    assert await reap(memory, run_id="live") == []  # its owner, this process, lives
    forced = await reap(memory, run_id="live", force=True)
    assert [(entry.kind, entry.sandbox_id) for entry in forced] == [("snapshot", live.snapshot_id)]
    assert await memory.list_snapshots() == [other_run]


async def test_a_snapshot_reap_could_not_delete_is_reported_not_raised() -> None:
    memory = FaultInjectingProvider(failure_rates={"delete_snapshot": 1.0})
    parent = await memory.create(SandboxSpec())
    stuck = await memory.snapshot(parent, metadata={"sandbox_middleware.run_id": "crashed", **dead_owner_stamp()})
    [entry] = await reap(memory)
    assert (entry.kind, entry.sandbox_id, entry.closed) == ("snapshot", stuck.snapshot_id, False)
    assert entry.error is not None and entry.error.startswith("InjectedFault: injected delete_snapshot failure")
    assert await memory.list_snapshots() == [stuck]
