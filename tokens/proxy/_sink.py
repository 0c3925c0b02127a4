"""Where the proxy's records go: NeMo Gym 0.7.0's ``TokenSink`` protocol, structurally (no import of NeMo Gym)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["TokenSink"]


@runtime_checkable
class TokenSink(Protocol):
    """A record store: ``put`` stores one record durably before returning; ``mark_incomplete``
    records that a call of a rollout failed to capture. ``begin_call`` (custody intent) is optional."""

    async def put(self, entry: Any) -> None: ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...
