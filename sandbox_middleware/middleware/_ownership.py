"""``OwnershipMiddleware``: every sandbox names its run and its owner process, and carries a TTL.

A sandbox whose create response was lost, or whose process was killed, is held by nobody; no
ledger inside a process can see it. Stamped with a run id and an owner that can be checked for
life, it can be found later (``SupportsSandboxList``) and reaped (``reap``) by any process, and the
TTL makes the provider end it even if nobody does, where the provider honours ``spec.ttl_s``.
Snapshots (``SupportsSandboxSnapshot``) carry the same stamp and an expiry, so ``reap`` removes a
crashed run's snapshots, and any snapshot past its expiry, like its sandboxes.

Both halves depend on the provider under the stack. One that cannot list its sandboxes (NeMo Gym
0.7.0's providers, among them) can never have them found or reaped, and one that drops
``spec.metadata`` on the way to its backend (NeMo Gym's ``docker`` writes only its own fixed label)
loses the stamp; the layer says so once per provider class, at construction, instead of promising
a reaper (``reapable``).
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, cast

from .._core import ProviderMiddleware, innermost
from .._errors import SandboxSnapshotError
from .._owner import EXPIRES_KEY, RUN_KEY, Owner
from .._protocol import (
    SandboxHandle,
    SandboxProvider,
    SandboxSnapshot,
    SandboxSpec,
    SupportsSandboxList,
    SupportsSandboxSnapshot,
)

__all__ = ["OwnershipMiddleware"]

logger = logging.getLogger("sandbox_middleware")
_WARNED: set[str] = set()  # provider classes already reported as unreapable, once per process


class OwnershipMiddleware(ProviderMiddleware):
    """Stamps each created sandbox's metadata with ``run_id`` and this process as its owner, and
    gives it ``ttl_s`` when the spec has none, so the provider ends it even if this process dies.

    ``run_id`` defaults to a fresh random id (``self.run_id``); give every worker of one run the
    same id. Keys: ``sandbox_middleware.run_id`` and ``sandbox_middleware.owner.{host,pid,started,pidns}``
    (the owner's PID namespace: only a process in it can tell whether the owner lives, see ``Owner``).

    A snapshot (where the provider takes them) gets the same stamp in its metadata and
    ``sandbox_middleware.expires``: ``ttl_s`` from when it was taken, in seconds since the epoch
    (none without ``ttl_s``), past which ``reap`` removes it. A create from a snapshot is stamped like
    any create; one from a snapshot whose stamp names another run is refused
    (``SandboxSnapshotError``): a run's snapshots are reaped with it, and a descriptor of another run's
    state is not this run's to read.
    """

    def __init__(self, inner: SandboxProvider, *, run_id: str | None = None, ttl_s: float | None = 3600.0) -> None:
        super().__init__(inner)
        self.run_id = run_id if run_id is not None else uuid.uuid4().hex[:16]
        self.ttl_s = ttl_s
        self._stamp = {RUN_KEY: self.run_id, **Owner.current().metadata()}
        self.reapable = isinstance(inner, SupportsSandboxList)
        """Whether the provider under this layer can list its sandboxes, so ``reap`` and the
        orphan search can find what this layer stamps; where not, only its TTL (if it honours
        ``ttl_s``) or a person ends a sandbox nobody holds."""
        bottom = innermost(inner)
        kind = f"{type(bottom).__module__}.{type(bottom).__qualname__}"
        if not self.reapable and kind not in _WARNED:
            _WARNED.add(kind)
            logger.warning(
                "OwnershipMiddleware: provider %r (%s) cannot list its sandboxes (no SupportsSandboxList), so "
                "reap and the orphan search can never find the ones it stamps; a sandbox whose create response "
                "is lost or whose process dies lives until the provider's own TTL (if it honours spec.ttl_s) "
                "or until someone removes it by hand",
                getattr(bottom, "name", "?"),
                kind,
            )

    @property
    def stamp(self) -> dict[str, str]:
        """The metadata this layer adds: this run and this process (``list``/``orphans`` filter on it)."""
        return dict(self._stamp)

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        source = extensions.get("from_snapshot")
        if isinstance(source, SandboxSnapshot) and source.metadata.get(RUN_KEY, self.run_id) != self.run_id:
            raise SandboxSnapshotError(
                f"{self.name}: snapshot {source.snapshot_id!r} belongs to run {source.metadata[RUN_KEY]!r}, not "
                f"to this run ({self.run_id!r}); fork only this run's snapshots (another run's are reaped with it)"
            )
        ttl = spec.ttl_s if spec.ttl_s is not None else self.ttl_s
        stamped = dataclasses.replace(spec, metadata={**spec.metadata, **self._stamp}, ttl_s=ttl)
        return await self.inner.create(stamped, **extensions)

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        stamp = dict(self._stamp)
        if self.ttl_s is not None:
            stamp[EXPIRES_KEY] = f"{time.time() + self.ttl_s:.3f}"
        inner = cast("SupportsSandboxSnapshot", self.inner)
        return await inner.snapshot(handle, paths=paths, metadata={**(metadata or {}), **stamp})
