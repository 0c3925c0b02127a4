"""The trainer's side: a frozen rollout as token arrays and loss masks, then a conditional drop.

``read_rollout(store, rollout_id)`` freezes the rollout, orders its records along their parent
links, rebuilds delta prompts (each checked against its digest) and feeds them through a
``Trajectory`` (so drift between turns is found and handled by its policy). Leaving the
``async with`` block without an exception drops the rollout, only if nothing changed since the
snapshot (``sample.dropped`` says whether it was).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

from ._order import order_records
from ._record import UNRESOLVED, TokenRecord
from ._trajectory import DriftPolicy, Segment, Trajectory
from ._types import TokenCaptureSnapshot

__all__ = ["RolloutSample", "read_rollout"]


@dataclass
class RolloutSample:
    """One frozen rollout, ready for a trainer.

    ``segments`` hold the token ids, loss masks (1 = generated) and log probabilities;
    ``records`` the records in chain order. ``trainable`` is False when the rollout is incomplete
    (a lost, failed or conflicting call), a call's parent was unresolved, or a segment drifted
    under the ``mask`` policy: mask such a sample rather than train on a chain with a hole.
    """

    snapshot: TokenCaptureSnapshot
    records: list[TokenRecord]
    trajectory: Trajectory
    dropped: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def rollout_id(self) -> str:
        return self.snapshot.rollout_id

    @property
    def segments(self) -> list[Segment]:
        return self.trajectory.segments

    @property
    def trainable(self) -> bool:
        return not self.notes and all(segment.trainable for segment in self.segments)


def sample_of(
    snapshot: TokenCaptureSnapshot, *, policy: DriftPolicy = "split", boundary_token_ids: Collection[int] = ()
) -> RolloutSample:
    trajectory = Trajectory(policy=policy, boundary_token_ids=boundary_token_ids)
    ordered = order_records(snapshot.entries)
    for _, bundle in ordered:
        trajectory.add(bundle)
    notes = ["incomplete: a call was lost, failed or conflicted"] if snapshot.incomplete else []
    notes += [
        f"model call {record.model_call_id!r}: parent unresolved ({record.parent_resolution_reason})"
        for record, _ in ordered
        if resolution_of(record) == UNRESOLVED
    ]
    return RolloutSample(snapshot, [record for record, _ in ordered], trajectory, notes=notes)


def resolution_of(record: Any) -> str:
    """A record's ``parent_resolution`` as its string (NeMo Gym's records hold an enum)."""
    status = record.parent_resolution
    return str(getattr(status, "value", status))


@contextlib.asynccontextmanager
async def read_rollout(
    store: Any, rollout_id: str, *, policy: DriftPolicy = "split", boundary_token_ids: Collection[int] = ()
) -> AsyncIterator[RolloutSample]:
    """Freeze ``rollout_id`` in ``store`` (a ``TokenSource``) and yield its ``RolloutSample``; on a
    clean exit drop it, conditionally on the snapshot consumed (``sample.dropped``)."""
    snapshot = await store.freeze(rollout_id)
    sample = sample_of(snapshot, policy=policy, boundary_token_ids=boundary_token_ids)
    yield sample
    sample.dropped = await store.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
