"""``OwnershipMiddleware``: every sandbox names its run and its owner process, and carries a TTL.

A sandbox whose create response was lost, or whose process was killed, is held by nobody; no
ledger inside a process can see it. Stamped with a run id and an owner that can be checked for
life, it can be found later (``SupportsSandboxList``) and reaped (``reap``) by any process, and the
TTL makes the provider end it even if nobody does, where the provider honours ``spec.ttl_s``.

Both halves depend on the provider under the stack. One that cannot list its sandboxes (NeMo Gym
0.7.0's providers, among them) can never have them found or reaped, and one that drops
``spec.metadata`` on the way to its backend (NeMo Gym's ``docker`` writes only its own fixed label)
loses the stamp; the layer says so once per provider class, at construction, instead of promising
a reaper (``reapable``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._core import ProviderMiddleware
from ._protocol import SandboxHandle, SandboxProvider, SandboxSpec, SupportsSandboxList

__all__ = ["RUN_KEY", "Owner", "OwnershipMiddleware"]

RUN_KEY = "sandbox_middleware.run_id"
_HOST_KEY = "sandbox_middleware.owner.host"
_PID_KEY = "sandbox_middleware.owner.pid"
_STARTED_KEY = "sandbox_middleware.owner.started"
logger = logging.getLogger("sandbox_middleware")
_WARNED: set[str] = set()  # provider classes already reported as unreapable, once per process


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if fields[0] != "Z" else None  # zombies are dead


@dataclass(frozen=True)
class Owner:
    """A process, identified across pid reuse: host, pid, and its start time on this boot."""

    host: str
    pid: int
    started: str  # "<boot id>:<start ticks>"

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, f"{_boot_id()}:{_start_ticks(pid)}")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> Owner | None:
        try:
            return cls(metadata[_HOST_KEY], int(metadata[_PID_KEY]), metadata[_STARTED_KEY])
        except (KeyError, ValueError):
            return None

    def metadata(self) -> dict[str, str]:
        return {_HOST_KEY: self.host, _PID_KEY: str(self.pid), _STARTED_KEY: self.started}

    def alive(self) -> bool | None:
        """True or False on this host; None where it cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        return f"{_boot_id()}:{_start_ticks(self.pid)}" == self.started

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"


class OwnershipMiddleware(ProviderMiddleware):
    """Stamps each created sandbox's metadata with ``run_id`` and this process as its owner, and
    gives it ``ttl_s`` when the spec has none, so the provider ends it even if this process dies.

    ``run_id`` defaults to a fresh random id (``self.run_id``); give every worker of one run the
    same id. Keys: ``sandbox_middleware.run_id`` and ``sandbox_middleware.owner.{host,pid,started}``.
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
        innermost = _innermost(inner)
        kind = f"{type(innermost).__module__}.{type(innermost).__qualname__}"
        if not self.reapable and kind not in _WARNED:
            _WARNED.add(kind)
            logger.warning(
                "OwnershipMiddleware: provider %r (%s) cannot list its sandboxes (no SupportsSandboxList), so "
                "reap and the orphan search can never find the ones it stamps; a sandbox whose create response "
                "is lost or whose process dies lives until the provider's own TTL (if it honours spec.ttl_s) "
                "or until someone removes it by hand",
                getattr(innermost, "name", "?"),
                kind,
            )

    @property
    def stamp(self) -> dict[str, str]:
        """The metadata this layer adds: this run and this process (``list``/``orphans`` filter on it)."""
        return dict(self._stamp)

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        ttl = spec.ttl_s if spec.ttl_s is not None else self.ttl_s
        stamped = dataclasses.replace(spec, metadata={**spec.metadata, **self._stamp}, ttl_s=ttl)
        return await self.inner.create(stamped, **extensions)


def _innermost(provider: Any) -> Any:
    while getattr(provider, "inner", None) is not None:
        provider = provider.inner
    return provider
