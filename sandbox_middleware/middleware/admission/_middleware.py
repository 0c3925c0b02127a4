"""``AdmissionMiddleware``: creates admitted within the provider's limits, and its refusals classified."""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, cast

import anyio
from opentelemetry.metrics import Counter, Histogram, MeterProvider

from ..._bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds
from ..._core import Operation, ProviderMiddleware, reduce_to_options
from ..._errors import (
    SandboxAdmissionError,
    SandboxArgumentError,
    SandboxQuotaExceededError,
    SandboxRateLimitedError,
)
from ..._groups import CreateGroup, current_group
from ..._protocol import SandboxHandle, SandboxProvider
from ..._telemetry import PROVIDER_ATTR, InstrumentBundle, Instruments, counter, duration_ms, safely
from ._ledger import BACKEND_TIMEOUT_S, Backend, HostBackend, ProcessBackend, default_host_path, owner_key
from ._quota import QuotaExhausted, RateLimited, classify

__all__ = ["THROTTLE_REASONS", "AdmissionMiddleware"]

T = TypeVar("T")

Shared = Literal["process", "host", "ray"]
REASON_ATTR = "reason"
THROTTLE_REASONS = ("max_held", "max_concurrent_creates", "max_create_rate", "retry_after", "rate_limited", "quota")
"""The ``reason`` values of ``gym.sandbox.admission.throttled_total``."""
_POLL_S = 0.05  # how often a waiter looks at a shared ledger for slots other processes freed
_CALL_TIMEOUT_S = BACKEND_TIMEOUT_S + 5  # a backstop: each backend bounds its own operations by BACKEND_TIMEOUT_S


class _Instruments(InstrumentBundle):
    wait: Histogram = duration_ms(
        "gym.sandbox.admission.wait_duration_ms",
        "Time a sandbox create waited to be admitted (caps, create rate, Retry-After, jitter).",
    )
    throttled: Counter = counter(
        "gym.sandbox.admission.throttled_total",
        "{create}",
        "Creates held back or refused by the admission layer, by reason.",
    )


class _Share:
    """What one group of creates (``_groups.py``) took here: whether its held slots were taken, how
    many no create of it holds yet, and whether the group ended (a create of it after: its own slot)."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.taken = self.ended = False
        self.left = 0


class AdmissionMiddleware(ProviderMiddleware):
    """Admits each create within the provider's limits, and classifies its refusals.

    - ``max_held``: at most this many sandboxes held at once (created through this layer, not yet
      closed; creates in flight count); ``max_concurrent_creates``: at most this many creates in
      flight; ``max_create_rate``: creates per second, a token bucket of ``burst`` tokens (the
      default 1 lets at most ``rate + 1`` creates into any one-second window);
      ``start_jitter_s``: each create first waits a random 0 to ``start_jitter_s`` seconds. None is
      no limit. A create takes a held slot, then a create slot, then a token; cancelled while it
      waits, it gives back what it took: it takes no slot and leaks nothing. The creates of one
      group (``Sandbox.fork``'s, ``_groups.py``) take their held slots in one step.
    - ``shared``: where the limits are counted: ``"process"`` (this layer), ``"host"`` (every
      process of this host naming the same ``shared_path`` SQLite file, default one per user in
      the temp directory) or ``"ray"`` (every process of a Ray cluster, through one small named
      actor). Processes share the limits of the same ``shared_key`` (default: the provider's name);
      each brings its own options, so give them the same ones.
    - A failed create is classified by ``QUOTA_CLASSIFIERS`` (HTTP 429, E2B's, Daytona's and
      Modal's rate-limit errors, quota messages; ``register_quota_classifier`` adds more). A rate
      limit pauses every create of the key for the ``Retry-After`` the provider sent (else
      ``default_retry_after_s``; at most ``max_retry_after_s``) and raises
      ``SandboxRateLimitedError``, a ``SandboxCreateError`` a retry layer above retries (after
      the pause: the retried create waits here). A hard quota raises
      ``SandboxQuotaExceededError`` naming the quota, which is never retried.

    Records ``gym.sandbox.admission.wait_duration_ms`` (one sample per admitted create) and
    ``gym.sandbox.admission.throttled_total`` by ``reason`` (``THROTTLE_REASONS``). Place it below
    the retry layer, so each attempt is admitted again.
    """

    _wrapped = frozenset({"create", "close"})
    BOUNDS: ClassVar[Bounds] = Bounds(
        "AdmissionMiddleware",
        max_concurrent_creates=AT_LEAST_ONE.or_none(),
        max_held=AT_LEAST_ONE.or_none(),
        max_create_rate=POSITIVE.or_none(),
        burst=AT_LEAST_ONE,
        start_jitter_s=NON_NEGATIVE,
        default_retry_after_s=NON_NEGATIVE,
        max_retry_after_s=NON_NEGATIVE,
    )

    def __init__(
        self,
        inner: SandboxProvider,
        *,
        max_concurrent_creates: int | None = None,
        max_held: int | None = None,
        max_create_rate: float | None = None,
        burst: int = 1,
        start_jitter_s: float = 0.0,
        shared: Shared = "process",
        shared_key: str | None = None,
        shared_path: Path | None = None,
        default_retry_after_s: float = 1.0,
        max_retry_after_s: float = 300.0,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        super().__init__(inner)
        self.BOUNDS.check(locals())
        if shared not in ("process", "host", "ray"):
            raise SandboxArgumentError(
                f"AdmissionMiddleware: shared must be 'process', 'host' or 'ray', not {shared!r}"
            )
        if shared_path is not None and shared != "host":
            raise SandboxArgumentError("AdmissionMiddleware: shared_path is the SQLite file of shared: host")
        self.max_concurrent_creates = max_concurrent_creates
        self.max_held = max_held
        self.max_create_rate = max_create_rate
        self.burst = burst
        self.start_jitter_s = start_jitter_s
        self.shared = shared
        self.shared_key = shared_key if shared_key is not None else inner.name
        self.shared_path = Path(shared_path) if shared_path is not None else None
        self.default_retry_after_s = default_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._meter_provider = meter_provider
        self._instruments = Instruments(_Instruments.create, meter_provider)
        self._attributes = {PROVIDER_ATTR: inner.name}
        self._backend: Backend = self._make_backend()
        self._owner = owner_key()
        self._held: set[str] = set()
        self._locks: dict[str, anyio.Lock] = {}
        self._freed: dict[str, anyio.Event] = {}
        self._random = random.Random()

    def _make_backend(self) -> Backend:
        if self.shared == "host":
            return HostBackend(self.shared_path or default_host_path(), self.shared_key)
        if self.shared == "ray":
            from ._ray import RayBackend

            return RayBackend(self.shared_key)
        return ProcessBackend()

    def __repr__(self) -> str:
        limits = {
            "max_concurrent_creates": self.max_concurrent_creates,
            "max_held": self.max_held,
            "max_create_rate": self.max_create_rate,
        }
        shown = ", ".join(f"{key}={value!r}" for key, value in limits.items() if value is not None)
        return f"AdmissionMiddleware({self.inner!r}, {shown + ', ' if shown else ''}shared={self.shared!r})"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Options travel, the state of this process (slots, locks, the backend's connection) does not.
        if self._meter_provider is not None:
            self._instruments.__reduce__()  # raises the TypeError saying why
        return reduce_to_options(AdmissionMiddleware, self)

    # -- telemetry ------------------------------------------------------------------------------

    def _throttled(self, reason: str) -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            attributes = {**self._attributes, REASON_ATTR: reason}
            safely("gym.sandbox.admission.throttled_total", instruments.throttled.add, 1, attributes)

    def _waited(self, started: float) -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            waited_ms = (time.perf_counter() - started) * 1000.0
            safely("gym.sandbox.admission.wait_duration_ms", instruments.wait.record, waited_ms, self._attributes)

    # -- the ledger -----------------------------------------------------------------------------

    async def _call(self, operation: str, *args: Any) -> Any:
        """One ledger operation, shielded: once asked, its answer is always taken into account."""
        try:
            with anyio.fail_after(_CALL_TIMEOUT_S, shield=True):
                return await self._backend.call(operation, *args)
        except TimeoutError:
            raise SandboxAdmissionError(
                f"admission: the shared limiter {self._backend!r} did not answer {operation} within "
                f"{_CALL_TIMEOUT_S:g} s; check it (the SQLite file's lock, the Ray cluster), or use "
                "shared: process"
            ) from None

    def _lock(self, kind: str) -> anyio.Lock:
        lock = self._locks.get(kind)
        if lock is None:
            lock = self._locks[kind] = anyio.Lock()  # FIFO: waiters of this process are admitted in order
        return lock

    async def _acquire(
        self,
        kind: str,
        limit: int,
        reason: str,
        took: Callable[[], None],
        count: int = 1,
        *,
        ahead: Callable[[], bool] | None = None,
    ) -> None:
        """Take ``count`` ``kind`` slots at once, waiting (holding nothing) until they are free; call
        ``took`` in the same step as the ledger's answer, so a cancellation after it cannot lose them.
        Waiters queue in order, except one with ``ahead``: a create of a group that holds its slots
        and needs one more (another group queued first may wait for this one's), which takes a slot
        as soon as one is free, or one its group gets back (``ahead()`` takes it and is true)."""
        operation, args = (
            ("acquire", (kind, self._owner, limit))
            if count == 1
            else ("acquire_many", (kind, self._owner, limit, count))
        )
        async with self._lock(kind) if ahead is None else contextlib.nullcontext():
            counted = False
            while True:
                if ahead is not None and ahead():
                    return
                if await self._call(operation, *args):
                    took()
                    return
                if not counted:
                    counted = True
                    self._throttled(reason)
                freed = self._freed.setdefault(kind, anyio.Event())
                if self._backend.shared:
                    with anyio.move_on_after(_POLL_S):
                        await freed.wait()
                else:
                    await freed.wait()

    async def _release(self, kind: str, count: int = 1) -> None:
        await self._call("release", kind, self._owner, count)
        self._wake(kind)

    def _wake(self, kind: str) -> None:
        """Wake this process's waiters for ``kind`` slots: one was freed."""
        freed = self._freed.pop(kind, None)
        if freed is not None:
            freed.set()

    async def _take_token(self) -> None:
        async with self._lock("rate"):
            counted: set[str] = set()
            while True:
                wait, reason = await self._call("take", self.max_create_rate, self.burst)
                if wait <= 0:
                    return
                if reason not in counted:
                    counted.add(reason)
                    self._throttled("max_create_rate" if reason == "rate" else reason)
                await anyio.sleep(wait)

    # -- the operations -------------------------------------------------------------------------

    async def around(self, operation: Operation[T]) -> T:
        if operation.name == "close":
            result = await operation()
            handle = operation.handle
            if handle is not None and handle.sandbox_id in self._held:
                self._held.discard(handle.sandbox_id)
                await self._release("held")
            return result
        return cast("T", await self._create(cast("Operation[SandboxHandle]", operation)))

    async def _create(self, operation: Operation[SandboxHandle]) -> SandboxHandle:
        started = time.perf_counter()
        if self.start_jitter_s:
            await anyio.sleep(self._random.uniform(0.0, self.start_jitter_s))
        taken: list[str] = []  # the slots this create holds, released at the end (held: by the close)
        group = current_group() if self.max_held is not None else None
        share = group.share(self, _Share) if group is not None else None
        try:
            if self.max_held is not None:
                if group is not None and share is not None:
                    await self._hold_for(group, share, taken, self.max_held)
                else:
                    await self._acquire("held", self.max_held, "max_held", lambda: taken.append("held"))
            if self.max_concurrent_creates is not None:
                limit = self.max_concurrent_creates
                await self._acquire("creating", limit, "max_concurrent_creates", lambda: taken.append("creating"))
            await self._take_token()
            self._waited(started)
            try:
                handle = await operation()
            except Exception as exc:
                await self._refused(exc)
                raise
            if "held" in taken:
                self._held.add(handle.sandbox_id)
                taken.remove("held")  # from here the close releases it
            return handle
        finally:
            for kind in reversed(taken):
                if kind == "held" and share is not None and not share.ended:
                    share.left += 1  # back to its group: a retry of this create takes it; the rest go at its end
                    self._wake("held")
                else:
                    await self._release(kind)

    async def _hold_for(self, group: CreateGroup, share: _Share, taken: list[str], limit: int) -> None:
        """A held slot of ``group``'s, all of whose creates still to come take theirs in one step (the
        first to arrive waits for them, the others for it); past what it took, a slot of its own,
        taken ahead of the queue."""
        async with share.lock:
            if not share.taken and not share.ended:
                count = max(1, group.size - group.made)
                parent_held = group.parent_id in self._held  # held all the while the group waits
                if count + parent_held > limit:
                    beside = " beside its parent's" if parent_held else ""
                    raise SandboxAdmissionError(
                        f"{self.inner.name}: a group of {count} creates made together (Sandbox.fork) needs "
                        f"{count} held slots at once{beside}, over max_held={limit}: raise max_held or fork fewer"
                    )

                def took() -> None:
                    share.taken, share.left = True, count
                    group.on_end(functools.partial(self._give_back, share))

                await self._acquire("held", limit, "max_held", took, count)

        def from_share() -> bool:
            if share.left > 0:
                share.left -= 1
                taken.append("held")
                return True
            return False

        await self._acquire("held", limit, "max_held", lambda: taken.append("held"), ahead=from_share)

    async def _give_back(self, share: _Share) -> None:
        """The held slots a group took and none of its creates kept."""
        left, share.left, share.ended = share.left, 0, True
        if left:
            await self._release("held", left)

    async def _refused(self, exc: Exception) -> None:
        """Raise the typed error a rate limit or a quota calls for (pausing the key first); else return."""
        verdict = classify(self.inner.name, exc)
        if isinstance(verdict, QuotaExhausted):
            self._throttled("quota")
            raise SandboxQuotaExceededError(
                f"{self.inner.name}: create refused, quota {verdict.quota!r} exhausted ({verdict.why}: {exc}); "
                "not retried: close sandboxes you hold, or raise the quota with the provider",
                provider=self.inner.name,
                quota=verdict.quota,
            ) from exc
        if isinstance(verdict, RateLimited):
            after = verdict.retry_after_s if verdict.retry_after_s is not None else self.default_retry_after_s
            after = min(after, self.max_retry_after_s)
            self._throttled("rate_limited")
            await self._call("pause", after)
            told = "as its Retry-After said" if verdict.retry_after_s is not None else "(no Retry-After: the default)"
            raise SandboxRateLimitedError(
                f"{self.inner.name}: create rate-limited by the provider ({verdict.why}: {exc}); every create of "
                f"{self.shared_key!r} waits {after:g} s {told}; a retry layer above retries it",
                provider=self.inner.name,
                retry_after_s=after,
            ) from exc

    async def aclose(self) -> None:
        try:
            with anyio.move_on_after(BACKEND_TIMEOUT_S, shield=True):
                try:
                    await self._backend.call("forget", self._owner)  # this process's slots are free now
                finally:  # failed or timed out: the backend's connection is released all the same
                    await self._backend.aclose()
        finally:
            self._held.clear()
            await self.inner.aclose()

    def held_slots(self) -> int:
        """Sandboxes this layer counts as held (created here and not yet closed)."""
        return len(self._held)
