"""The proxy's records: one per captured call with a rollout id, through ``tokens.records.RecordWriter``.

Every dialect is recorded as the chat completion it was served as (the converted messages are
the lineage's items, so a continuation in any dialect finds its parent; ``_answers`` makes it, whole
or gathered from a stream). The call is in a ``tokens.records`` custody: ``begin_call`` runs before
anything is sent upstream; a capture failure (or a cancellation before the record) marks the rollout
incomplete, so a trainer masks it instead of training on a chain with a hole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .._bundle import TokenCompletion
from ..records import (
    Coordinates,
    Custody,
    RecordsError,
    RecordWriteError,
    RecordWriter,
    RolloutFrozenError,
    RolloutRetiredError,
)
from ..records._writer import UNRECORDED
from ._errors import CaptureFailedError, ProxyError

__all__ = ["Recorder"]

logger = logging.getLogger("tokens.proxy")


def _capture_failed(exc: BaseException) -> bool:
    return isinstance(exc, CaptureFailedError)


class _ProxyCustody(Custody):
    """A recorded call's custody as the proxy answers it: a frozen or retired rollout a 409, a failing
    store a 503 (its details go to the log only); its record names what the conversion left out of the
    client's request (``dropped``)."""

    def __init__(self, writer: RecordWriter, coordinates: Coordinates, dropped: Sequence[Mapping[str, Any]]) -> None:
        super().__init__(writer, coordinates, _capture_failed)
        self.dropped = dropped

    async def begin(self) -> None:
        coordinates = self.coordinates
        try:
            await super().begin()
        except (RolloutFrozenError, RolloutRetiredError) as exc:  # a frozen or retired rollout takes no more calls
            raise ProxyError(f"rollout {coordinates.rollout_id!r} takes no more calls: {exc}", status=409) from None
        except RecordsError as exc:  # the store itself: its details (a path, a host) go to the log only
            logger.warning(
                "rollout %r, model call %r: begin_call failed: %s",
                coordinates.rollout_id,
                coordinates.model_call_id,
                exc,
            )
            raise ProxyError(
                f"the record store failed ({type(exc).__name__}); nothing was sent upstream: retry the call",
                status=503,
            ) from None

    async def write_chat(
        self, request: Mapping[str, Any], completion: TokenCompletion, server_version: str | None = None
    ) -> None:
        """Put the record (``request`` is the chat request as served: its messages are the lineage's
        items), with what the conversion left out of the client's request (``dropped``)."""
        try:
            await super().write_chat(request, completion, server_version)
        except RecordWriteError as exc:  # its details (the store's path or host) go to the log only
            logger.error("%s", exc)
            raise ProxyError(
                f"rollout {self.coordinates.rollout_id!r}, model call {self.coordinates.model_call_id!r}: the record "
                "was not stored and the rollout could not be marked incomplete (the record store failed; see the "
                "proxy's log)"
            ) from None


class Recorder:
    """The proxy's side of ``tokens.records``: one custody per call with a rollout id (none without a store)."""

    def __init__(self, store: Any) -> None:
        self.writer = None if store is None else RecordWriter(store)

    def custody(self, coordinates: Coordinates | None, dropped: Sequence[Mapping[str, Any]] = ()) -> Custody:
        """The call's custody (``dropped``: what its conversion left out, recorded); one that records
        nothing (``recorded`` False) without a store or a rollout id."""
        if self.writer is None or coordinates is None:
            return UNRECORDED
        return _ProxyCustody(self.writer, coordinates, dropped)
