"""The value types of NeMo Gym's record protocols, structurally identical to its own.

When NeMo Gym is installed (and its ``token_id_capture`` imports), its own classes are the ones
produced: ``TokenEntry`` for records, ``TokenCaptureSnapshot``, ``LineageMatch``,
``LineageResolution`` and ``ParentResolutionStatus``; without it, the stand-alone classes below
(same fields, same checks). The type checker sees the stand-alone ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = [
    "LineageMatch",
    "LineageResolution",
    "ParentResolutionStatus",
    "TokenCaptureSnapshot",
    "nemo_module",
]

logger = logging.getLogger("tokens.records")


def nemo_module(name: str) -> ModuleType | None:
    """NeMo Gym's ``nemo_gym.token_id_capture.NAME`` when installed and importable, else None."""
    if importlib.util.find_spec("nemo_gym") is None:
        return None
    try:
        return importlib.import_module(f"nemo_gym.token_id_capture.{name}")
    except Exception as exc:  # installed but broken here: stand alone
        logger.warning("NeMo Gym is installed but its token_id_capture does not import (%r); standing alone", exc)
        return None


class _ParentResolutionStatus(StrEnum):
    """Whether a model call has a proven captured predecessor."""

    ROOT = "root"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"


@dataclass(frozen=True)
class _TokenCaptureSnapshot:
    """An immutable view of one rollout's frozen records (``entries`` in no particular order)."""

    rollout_id: str
    entries: tuple[Any, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True)
class _LineageMatch:
    """A uniquely verified parent: its id, cumulative tokens (prompt + generation) and digest."""

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...] = ()
    prev_len: int = 0
    chain_hash: str = ""


@dataclass(frozen=True)
class _LineageResolution:
    """One request-time parent decision; ``match`` exactly when ``RESOLVED``."""

    status: _ParentResolutionStatus
    match: _LineageMatch | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.status == _ParentResolutionStatus.RESOLVED) != (self.match is not None):
            raise ValueError(f"a {self.status} lineage resolution carries a match exactly when resolved")


_PROTOCOLS = nemo_module("protocols")
_RECORDS = nemo_module("records") if _PROTOCOLS is not None else None

if TYPE_CHECKING:
    ParentResolutionStatus = _ParentResolutionStatus
    TokenCaptureSnapshot = _TokenCaptureSnapshot
    LineageMatch = _LineageMatch
    LineageResolution = _LineageResolution
elif _PROTOCOLS is not None and _RECORDS is not None:
    ParentResolutionStatus = _RECORDS.ParentResolutionStatus
    TokenCaptureSnapshot = _PROTOCOLS.TokenCaptureSnapshot
    LineageMatch = _PROTOCOLS.LineageMatch
    LineageResolution = _PROTOCOLS.LineageResolution
else:
    ParentResolutionStatus = _ParentResolutionStatus
    TokenCaptureSnapshot = _TokenCaptureSnapshot
    LineageMatch = _LineageMatch
    LineageResolution = _LineageResolution

NEMO_TOKEN_ENTRY: Any = _RECORDS.TokenEntry if _RECORDS is not None and _PROTOCOLS is not None else None
"""NeMo Gym's ``TokenEntry`` class, or None."""
