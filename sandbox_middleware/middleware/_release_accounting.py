"""``ReleaseAccountingMiddleware``: how many sandboxes are held right now, and which."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
from opentelemetry.metrics import MeterProvider, UpDownCounter

from .._bounds import AT_LEAST_ONE, POSITIVE, Bounds
from .._core import ProviderMiddleware
from .._errors import SandboxError
from .._protocol import SandboxHandle, SandboxListing, SandboxProvider, SandboxSpec, SupportsSandboxList
from .._sandbox import close_shielded
from .._telemetry import PROVIDER_ATTR, InstrumentBundle, Instruments, safely, up_down_counter

__all__ = ["HeldSandbox", "ReleaseAccountingMiddleware"]

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


class _Instruments(InstrumentBundle):
    active: UpDownCounter = up_down_counter(
        "gym.sandbox.active", "{sandbox}", "Sandboxes this process currently holds, from provider create to release."
    )


class ReleaseAccountingMiddleware(ProviderMiddleware):
    """Counts ``gym.sandbox.active`` (+1 per handle create returned, -1 once close returned) and
    keeps a ledger of the sandboxes held, ``held()``.

    A close that raised released nothing: the sandbox stays counted and is marked
    ``release_failed``; a later successful close subtracts once, a repeated close nothing. A failed
    create counts nothing, and a handle from ``connect()`` is neither counted nor subtracted (the
    process that created it counts it). Ledger operations are O(1).

    On ``aclose()`` sandboxes still held are logged in one warning naming them; with
    ``release_on_aclose=True`` they are closed first (shielded, ``release_timeout_s`` each) and
    the warning names those that could not be released.
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
        self.peak_held = 0
        """The most sandboxes this layer held at once (its high-water mark of ``gym.sandbox.active``)."""
        self.release_on_aclose = release_on_aclose
        self.release_timeout_s = release_timeout_s
        self.release_concurrency = release_concurrency

    def held(self) -> list[HeldSandbox]:
        """The sandboxes this layer holds now, oldest first."""
        return list(self._ledger.values())

    def _add(self, delta: int) -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            safely("gym.sandbox.active", instruments.active.add, delta, self._attributes)

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
        """Close every held sandbox (shielded, bounded, concurrently); return those still held."""
        limiter = anyio.CapacityLimiter(max(1, self.release_concurrency))

        async def release(entry: HeldSandbox) -> None:
            async with limiter:
                try:
                    await close_shielded(self, entry.handle, self.release_timeout_s)
                except Exception as exc:
                    logger.warning("could not release sandbox %s: %r", entry.sandbox_id, exc)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for entry in self.held():
                    tg.start_soon(release, entry)
        return self.held()

    async def aclose(self) -> None:
        remaining = await self.release_held() if self.release_on_aclose and self._ledger else self.held()
        if remaining:
            what = "could not be released" if self.release_on_aclose else "are still held (leaked?)"
            logger.warning(
                "%s: %d sandbox(es) %s at aclose: %s",
                self.inner.name,
                len(remaining),
                what,
                ", ".join(entry.sandbox_id for entry in remaining),
            )
        await self.inner.aclose()
