"""The listing capability: find sandboxes by metadata, including those no process holds a handle to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ._protocol import SandboxHandle

__all__ = ["SandboxListing", "SupportsSandboxList"]


@dataclass(frozen=True)
class SandboxListing:
    """One sandbox a provider knows of: a handle usable with ``close``, its metadata, its creation time."""

    handle: SandboxHandle
    metadata: Mapping[str, str] = field(default_factory=dict)
    created_at: float | None = None  # seconds since the epoch, where the provider knows it


@runtime_checkable
class SupportsSandboxList(Protocol):
    """Optional capability: list the provider's sandboxes whose metadata contains every item of ``metadata``."""

    async def list(self, *, metadata: Mapping[str, str] | None = None) -> list[SandboxListing]: ...
