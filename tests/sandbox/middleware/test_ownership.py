"""``OwnershipMiddleware`` and snapshots: each is stamped with its run, owner and expiry; a create from one
is stamped like any create; another run's snapshot is refused."""

from __future__ import annotations

import os
import time

import pytest

from sandbox_middleware import (
    OwnershipMiddleware,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
    SandboxSpec,
    SupportsSandboxSnapshot,
)
from sandbox_middleware.testing import FaultInjectingProvider
from tests.providers import PlainProvider

pytestmark = pytest.mark.anyio

RUN = "sandbox_middleware.run_id"
EXPIRES = "sandbox_middleware.expires"


async def test_snapshots_carry_the_run_the_owner_and_an_expiry() -> None:
    memory = FaultInjectingProvider()
    layer = OwnershipMiddleware(memory, run_id="r1", ttl_s=900)
    handle = await layer.create(SandboxSpec())
    before = time.time()
    snapshot = await layer.snapshot(handle, metadata={"task": "t1", RUN: "forged"})
    assert snapshot.metadata["task"] == "t1"
    assert snapshot.metadata[RUN] == "r1"  # the stamp wins over what the caller wrote
    assert snapshot.metadata["sandbox_middleware.owner.pid"] == str(os.getpid())
    assert before + 900 - 0.001 <= float(snapshot.metadata[EXPIRES]) <= time.time() + 900 + 0.001
    assert await memory.list_snapshots(metadata={RUN: "r1"}) == [snapshot]  # the provider keeps the stamp
    unbounded = OwnershipMiddleware(memory, run_id="r1", ttl_s=None)
    assert EXPIRES not in (await unbounded.snapshot(handle)).metadata


async def test_a_fork_is_stamped_like_any_create_and_another_runs_snapshot_is_refused() -> None:
    memory = FaultInjectingProvider()
    mine, theirs = OwnershipMiddleware(memory, run_id="mine"), OwnershipMiddleware(memory, run_id="theirs")
    snapshot = await mine.snapshot(await mine.create(SandboxSpec()))
    fork = await mine.create(SandboxSpec(metadata={"fork": "0"}), from_snapshot=snapshot)
    [listed] = await memory.list(metadata={"fork": "0"})
    assert listed.handle.sandbox_id == fork.sandbox_id and listed.metadata[RUN] == "mine"
    with pytest.raises(SandboxSnapshotError, match="belongs to run 'mine', not to this run \\('theirs'\\)"):
        await theirs.create(SandboxSpec(), from_snapshot=snapshot)
    # A descriptor relabelled as the other run's is refused by the provider: it is not the one it holds.
    relabelled = type(snapshot)(**{**snapshot.to_dict(), "metadata": {**snapshot.metadata, RUN: "theirs"}})
    with pytest.raises(SandboxSnapshotNotFoundError):
        await theirs.create(SandboxSpec(), from_snapshot=relabelled)
    # Unstamped snapshots (taken under no ownership layer) are no run's: any run forks them.
    bare = await memory.snapshot(fork)
    await theirs.create(SandboxSpec(), from_snapshot=bare)
    assert len(memory.alive) == 3  # the parent, its fork, the fork of the bare snapshot: the refused made none
    assert {listing.metadata[RUN] for listing in await memory.list()} == {"mine", "theirs"}


def test_the_snapshot_override_vanishes_without_the_capability() -> None:
    layer = OwnershipMiddleware(PlainProvider())
    assert not isinstance(layer, SupportsSandboxSnapshot) and layer.snapshot is None  # type: ignore[comparison-overlap]
