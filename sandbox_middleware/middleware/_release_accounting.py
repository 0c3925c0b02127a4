"""``ReleaseAccountingMiddleware``: how many sandboxes (and snapshots) are held right now, and which."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import anyio
from opentelemetry.metrics import MeterProvider, UpDownCounter

from .._bounds import AT_LEAST_ONE, POSITIVE, Bounds
from .._core import ProviderMiddleware
from .._errors import SandboxError
from .._protocol import (
    SandboxHandle,
    SandboxListing,
    SandboxProvider,
    SandboxSnapshot,
    SandboxSpec,
    SupportsSandboxList,
    SupportsSandboxSnapshot,
)
from .._sandbox import close_shielded
from .._telemetry import PROVIDER_ATTR, InstrumentBundle, Instruments, safely, up_down_counter

__all__ = ["HeldSandbox", "HeldSnapshot", "ReleaseAccountingMiddleware"]

logger = logging.getLogger("sandbox_middleware")


@dataclass(frozen=True, slots=True)
class HeldSandbox:
    """One sandbox this layer obtained from ``create`` and has not seen released."""

    sandbox_id: str
    provider: str
    since: float
    """Wall-clock time (``time.time()``) when create handed the handle back."""
    release_failed: bool
    """A close was tried and raised; the provider may still hold it."""
    handle: SandboxHandle


@dataclass(frozen=True, slots=True)
class HeldSnapshot:
    """One snapshot this layer saw ``snapshot`` take and has not seen deleted."""

    snapshot_id: str
    provider: str
    since: float
    """Wall-clock time (``time.time()``) when ``snapshot`` returned it."""
    delete_failed: bool
    """A delete was tried and raised; the provider may still hold it."""
    snapshot: SandboxSnapshot


class _Instruments(InstrumentBundle):
    active: UpDownCounter = up_down_counter(
        "gym.sandbox.active", "{sandbox}", "Sandboxes this process currently holds, from provider create to release."
    )
    snapshots: UpDownCounter = up_down_counter(
        "gym.sandbox.snapshot.active", "{snapshot}", "Snapshots this process currently holds, from taken to deleted."
    )


class ReleaseAccountingMiddleware(ProviderMiddleware):
    """Counts ``gym.sandbox.active`` (+1 per handle create returned, -1 once close returned) and
    keeps a ledger of the sandboxes held, ``held()``.

    A close that raised released nothing: the sandbox stays counted and is marked
    ``release_failed``; a later successful close subtracts once, a repeated close nothing. A failed
    create counts nothing, and a handle from ``connect()`` is neither counted nor subtracted (the
    process that created it counts it). Ledger operations are O(1).

    Snapshots (where the provider takes them) are held the same way: ``gym.sandbox.snapshot.active``
    +1 per snapshot taken, -1 once its delete returned, a delete that raised marks it
    ``delete_failed``; ``held_snapshots()`` lists them. A create from a snapshot is a create like any.

    On ``aclose()`` sandboxes and snapshots still held are logged in one warning each naming them;
    with ``release_on_aclose=True`` they are closed (deleted) first (shielded, ``release_timeout_s``
    each) and the warnings name those that could not be released.
    """

    BOUNDS: ClassVar[Bounds] = Bounds(
        "ReleaseAccountingMiddleware", release_timeout_s=POSITIVE, release_concurrency=AT_LEAST_ONE
    )

    def __init__(
        self,
        inner: SandboxProvider,
        *,
        meter_provider: MeterProvider | None = None,
        release_on_aclose: bool = False,
        release_timeout_s: float = 60.0,
        release_concurrency: int = 64,
    ) -> None:
        super().__init__(inner)
        self.BOUNDS.check(locals())
        self._instruments = Instruments(_Instruments.create, meter_provider)
        self._attributes = {PROVIDER_ATTR: inner.name}
        self._ledger: dict[str, HeldSandbox] = {}
        self._snapshots: dict[str, HeldSnapshot] = {}
        self.peak_held = 0
        """The most sandboxes this layer held at once (its high-water mark of ``gym.sandbox.active``)."""
        self.release_on_aclose = release_on_aclose
        self.release_timeout_s = release_timeout_s
        self.release_concurrency = release_concurrency

    def held(self) -> list[HeldSandbox]:
        """The sandboxes this layer holds now, oldest first."""
        return list(self._ledger.values())

    def held_snapshots(self) -> list[HeldSnapshot]:
        """The snapshots this layer holds now, oldest first."""
        return list(self._snapshots.values())

    def _add(self, delta: int, what: str = "active") -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            name = "gym.sandbox.active" if what == "active" else "gym.sandbox.snapshot.active"
            safely(name, getattr(instruments, what).add, delta, self._attributes)

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        handle = await self.inner.create(spec, **extensions)
        self._ledger[handle.sandbox_id] = HeldSandbox(handle.sandbox_id, self.inner.name, time.time(), False, handle)
        self.peak_held = max(self.peak_held, len(self._ledger))
        self._add(1)
        return handle

    async def close(self, handle: SandboxHandle, **extensions: Any) -> None:
        try:
            await self.inner.close(handle, **extensions)
        except BaseException:
            entry = self._ledger.get(handle.sandbox_id)
            if entry is not None and not entry.release_failed:
                self._ledger[handle.sandbox_id] = dataclasses.replace(entry, release_failed=True)
            raise
        if self._ledger.pop(handle.sandbox_id, None) is not None:
            self._add(-1)

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        taken = await cast("SupportsSandboxSnapshot", self.inner).snapshot(handle, paths=paths, metadata=metadata)
        self._snapshots[taken.snapshot_id] = HeldSnapshot(taken.snapshot_id, self.inner.name, time.time(), False, taken)
        self._add(1, "snapshots")
        return taken

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        try:
            await cast("SupportsSandboxSnapshot", self.inner).delete_snapshot(snapshot)
        except BaseException:
            entry = self._snapshots.get(getattr(snapshot, "snapshot_id", None))  # type: ignore[arg-type]
            if entry is not None and not entry.delete_failed:
                self._snapshots[snapshot.snapshot_id] = dataclasses.replace(entry, delete_failed=True)
            raise
        if self._snapshots.pop(snapshot.snapshot_id, None) is not None:
            self._add(-1, "snapshots")

    async def orphans(self, metadata: Mapping[str, str]) -> list[SandboxListing]:
        """Sandboxes the provider lists with ``metadata`` that this ledger does not hold.

        Pass ``OwnershipMiddleware.stamp`` (this run and this process) to find the sandboxes whose
        create response was lost: they exist, and nobody holds their handle. ``reap`` closes them.
        Needs a provider with ``SupportsSandboxList``.
        """
        if not isinstance(self.inner, SupportsSandboxList):
            raise SandboxError(
                f"{self.inner.name}: cannot look for orphans, the provider cannot list its sandboxes "
                "(no SupportsSandboxList)"
            )
        listed = await self.inner.list(metadata=metadata)
        return [listing for listing in listed if listing.handle.sandbox_id not in self._ledger]

    async def release_held(self) -> list[HeldSandbox]:
        """Close every held sandbox and delete every held snapshot (shielded, each bounded by
        ``release_timeout_s``, concurrently); return the sandboxes still held (``held_snapshots()``
        the snapshots)."""
        limiter = anyio.CapacityLimiter(max(1, self.release_concurrency))

        async def release(entry: HeldSandbox | HeldSnapshot) -> None:
            async with limiter:
                try:
                    if isinstance(entry, HeldSandbox):
                        await close_shielded(self, entry.handle, self.release_timeout_s)
                    else:
                        with anyio.fail_after(self.release_timeout_s):
                            await self.delete_snapshot(entry.snapshot)
                except Exception as exc:
                    kind = "sandbox" if isinstance(entry, HeldSandbox) else "snapshot"
                    logger.warning("could not release %s %s: %r", kind, _id(entry), exc)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                entries: list[HeldSandbox | HeldSnapshot] = [*self.held(), *self.held_snapshots()]
                for entry in entries:
                    tg.start_soon(release, entry)
        return self.held()

    async def aclose(self) -> None:
        if self.release_on_aclose and (self._ledger or self._snapshots):
            await self.release_held()
        what = "could not be released" if self.release_on_aclose else "are still held (leaked?)"
        for remaining, kind in ((self.held(), "sandbox(es)"), (self.held_snapshots(), "snapshot(s)")):
            if remaining:
                logger.warning(
                    "%s: %d %s %s at aclose: %s",
                    self.inner.name,
                    len(remaining),
                    kind,
                    what,
                    ", ".join(map(_id, remaining)),
                )
        await self.inner.aclose()


def _id(entry: HeldSandbox | HeldSnapshot) -> str:
    return entry.sandbox_id if isinstance(entry, HeldSandbox) else entry.snapshot_id
