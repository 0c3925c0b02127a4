"""``WarmPoolMiddleware``: ready sandboxes handed out at once, refilled in the background."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

import anyio
import anyio.abc
import anyio.lowlevel
from opentelemetry.metrics import Counter, Histogram, MeterProvider, UpDownCounter

from .._bounds import AT_LEAST_ONE, POSITIVE, Bounds
from .._core import Operation, ProviderMiddleware, reduce_to_options
from .._errors import SandboxSnapshotNotFoundError
from .._groups import current_group
from .._protocol import SandboxHandle, SandboxProvider, SandboxSnapshot, SandboxSpec, SupportsSandboxSnapshot
from .._sandbox import close_shielded
from .._telemetry import PROVIDER_ATTR, InstrumentBundle, Instruments, counter, duration_ms, safely, up_down_counter

__all__ = ["INTERCHANGEABLE_FIELDS", "WarmPoolMiddleware", "spec_key"]

T = TypeVar("T")

logger = logging.getLogger("sandbox_middleware.warm_pool")

INTERCHANGEABLE_FIELDS = (
    "image",
    "resources",
    "env",
    "workdir",
    "entrypoint",
    "ports",
    "ttl_s",
    "metadata",
    "provider_options",
)
"""The ``SandboxSpec`` fields that make two sandboxes interchangeable: a pooled sandbox made for one
spec is handed out for another only when all of these are equal. Not among them: ``files`` (the
facade writes them after the hand-out) and ``ready_timeout_s`` (how long to wait, not what is made)."""

RESULT_ATTR = "result"
_BACKOFF_S = (0.5, 30.0)  # a failing refill waits from the first to the second, doubling


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(key), _canonical(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_canonical(item) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return tuple((name, _canonical(getattr(value, name))) for name in value.__dataclass_fields__)
    return repr(value) if not isinstance(value, str | int | float | bool | type(None)) else value


def spec_key(spec: SandboxSpec, snapshot: SandboxSnapshot | None = None) -> tuple[Any, ...]:
    """The pool a spec's sandbox comes from: its ``INTERCHANGEABLE_FIELDS``, canonically ordered, and the
    whole descriptor of the snapshot it is made from (None: an empty sandbox), so a pooled fork is
    handed out only for a descriptor equal to the one it was made from (an altered one reaches the
    provider, which refuses it)."""
    fields = tuple(_canonical(getattr(spec, name)) for name in INTERCHANGEABLE_FIELDS)
    return (*fields, _canonical(snapshot))


class _Instruments(InstrumentBundle):
    handout: Histogram = duration_ms(
        "gym.sandbox.pool.handout_duration_ms",
        "Time create took through the warm pool: a ready sandbox (hit) or a provider start (miss).",
    )
    handouts: Counter = counter("gym.sandbox.pool.handout_total", "{create}", "Creates through the pool, by result.")
    ready: UpDownCounter = up_down_counter(
        "gym.sandbox.pool.ready", "{sandbox}", "Ready sandboxes waiting in the pool."
    )
    recycled: Counter = counter(
        "gym.sandbox.pool.recycled_total",
        "{sandbox}",
        "Pooled sandboxes closed without being handed out, by reason (max_age, drain).",
    )


@dataclass
class _Pool:
    """One spec key's sandboxes: ready ones (oldest first, with when each was created), and refills."""

    spec: SandboxSpec
    snapshot: SandboxSnapshot | None = None
    """What its sandboxes are forks of (None: empty ones)."""
    removed: bool = False
    """Its snapshot was deleted: refills in flight are closed as they land, nothing is handed out."""
    ready: deque[tuple[float, SandboxHandle]] = field(default_factory=deque)
    creating: int = 0
    waiting: int = 0
    """Misses waiting for a refill in flight (each claims one)."""
    landed: anyio.Event | None = None
    """Set when a refill in flight lands or fails (the waiting misses look again)."""
    failures: int = 0
    retry_at: float = 0.0


class WarmPoolMiddleware(ProviderMiddleware):
    """Keeps ``size`` (default 8) ready sandboxes per spec key and hands one out at once on ``create``.

    A spec's key is its ``INTERCHANGEABLE_FIELDS`` (image, resources, env, workdir, entrypoint,
    ports, ttl_s, metadata, provider_options): a sandbox is handed out only for a spec equal in all
    of them. The pools of ``specs`` are filled from the first create on; a create of another key
    is a miss that creates through the layers below as usual and starts a pool for that key (at
    most ``max_keys`` pools: the other keys always create). Pooled sandboxes are created in the
    background through the layers below, so they are admitted, counted held, stamped and retried
    like any other, at most ``refill_concurrency`` at a time (default ``size``); a failing refill
    backs off. A pooled sandbox older than ``max_age_s`` is closed instead of handed out (keep it
    below the TTL of the sandboxes). A create with provider keyword arguments bypasses the pool.

    Where the provider takes snapshots, ``create(spec, from_snapshot=snapshot)`` is pooled per
    ``(spec key, snapshot)``: a pool of ready forks of that prepared state, started by the first such
    create, refilled by creates from the same snapshot through the layers below. A fork is handed out
    only for an equal descriptor of the same snapshot, never for another or for a create without one.
    ``delete_snapshot`` drains the snapshot's pools (their ready forks are closed, reason
    ``snapshot_deleted``; refills in flight are closed as they land). Pool forks of a snapshot kept
    for a while (many groups of one task, ``create(spec, from_snapshot=kept)``). ``Sandbox.fork``'s
    creates pass through (one group, ``_groups.py``): its snapshot is new and deleted once its forks
    are made, and a fork waiting for the pool's refills could wait, under a held cap, for slots its
    own group holds.

    ``aclose`` stops the refills (those in flight finish, bounded by ``create_timeout_s``), closes
    every pooled sandbox (shielded, ``close_timeout_s`` each) and closes the layers below.
    ``close`` passes through: a handed-out sandbox is the caller's, never pooled again.

    Records ``gym.sandbox.pool.handout_duration_ms`` and ``gym.sandbox.pool.handout_total`` (``result``
    ``hit`` or ``miss``), ``gym.sandbox.pool.ready`` and ``gym.sandbox.pool.recycled_total`` (``reason``
    ``max_age``, ``drain`` or ``snapshot_deleted``).
    The provider's own start time stays ``gym.sandbox.startup_duration_ms`` of a metrics layer below.
    """

    _wrapped = frozenset({"create"})
    BOUNDS: ClassVar[Bounds] = Bounds(
        "WarmPoolMiddleware",
        size=AT_LEAST_ONE.at_most(1024),  # per spec key: a larger "pool" is a fleet that outlives its use
        max_age_s=POSITIVE.or_none(),
        refill_concurrency=AT_LEAST_ONE.or_none(),
        max_keys=AT_LEAST_ONE.at_most(256),
        create_timeout_s=POSITIVE,
        close_timeout_s=POSITIVE,
    )

    def __init__(
        self,
        inner: SandboxProvider,
        *,
        size: int = 8,
        max_age_s: float | None = None,
        specs: Sequence[SandboxSpec] = (),
        refill_concurrency: int | None = None,
        max_keys: int = 16,
        create_timeout_s: float = 600.0,
        close_timeout_s: float = 60.0,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        super().__init__(inner)
        self.BOUNDS.check(locals())
        self.size = size
        self.max_age_s = max_age_s
        self.specs = tuple(specs)
        self.refill_concurrency = refill_concurrency if refill_concurrency is not None else size
        self.max_keys = max_keys
        self.create_timeout_s = create_timeout_s
        self.close_timeout_s = close_timeout_s
        self._meter_provider = meter_provider
        self._instruments = Instruments(_Instruments.create, meter_provider)
        self._attributes = {PROVIDER_ATTR: inner.name}
        self._pools: dict[tuple[Any, ...], _Pool] = {}
        self._creating = 0
        self._wake: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._draining = False
        self._running = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._aged: list[SandboxHandle] = []
        self._refilled: anyio.Event | None = None  # set after each refill (wait_ready)
        for spec in self.specs:
            self._pool(spec)

    def __repr__(self) -> str:
        return f"WarmPoolMiddleware({self.inner!r}, size={self.size}, max_age_s={self.max_age_s})"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Options travel; the pooled sandboxes and the refill task belong to this process.
        if self._meter_provider is not None:
            self._instruments.__reduce__()  # raises the TypeError saying why
        return reduce_to_options(WarmPoolMiddleware, self)

    def ready(self) -> int:
        """Ready sandboxes in every pool now."""
        return sum(len(pool.ready) for pool in self._pools.values())

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Start filling the pools (those of ``specs``, and of the keys seen so far) and wait until each
        holds ``size`` ready sandboxes; ``TimeoutError`` after ``timeout_s``. Optional: the first
        create starts the refills anyway."""
        self._start()
        with anyio.fail_after(timeout_s):
            while any(len(pool.ready) < self.size for pool in self._pools.values()):
                if self._refilled is None or self._refilled.is_set():  # one event for every waiter
                    self._refilled = anyio.Event()
                await self._refilled.wait()

    # -- telemetry ------------------------------------------------------------------------------

    def _record(self, name: str, *args: Any) -> None:
        instruments = self._instruments.get()
        if instruments is None:
            return
        if name == "handout":
            started, result = args
            attributes = {**self._attributes, RESULT_ATTR: result}
            waited_ms = (time.perf_counter() - started) * 1000.0
            safely("gym.sandbox.pool.handout_duration_ms", instruments.handout.record, waited_ms, attributes)
            safely("gym.sandbox.pool.handout_total", instruments.handouts.add, 1, attributes)
        elif name == "ready":
            safely("gym.sandbox.pool.ready", instruments.ready.add, args[0], self._attributes)
        else:
            attributes = {**self._attributes, "reason": args[0]}
            safely("gym.sandbox.pool.recycled_total", instruments.recycled.add, 1, attributes)

    # -- hand-out -------------------------------------------------------------------------------

    def _pool(self, spec: SandboxSpec, snapshot: SandboxSnapshot | None = None) -> _Pool | None:
        key = spec_key(spec, snapshot)
        pool = self._pools.get(key)
        if pool is None and len(self._pools) < self.max_keys and not self._draining:
            pool = self._pools[key] = _Pool(spec, snapshot)
            self._notify()  # an idle refill task waits for a wake-up: a new key is one
        return pool

    async def around(self, operation: Operation[T]) -> T:
        spec = operation.spec
        extensions = operation.extensions
        snapshot = extensions.pop("from_snapshot", None)
        poolable = snapshot is None or (
            isinstance(snapshot, SandboxSnapshot) and isinstance(self.inner, SupportsSandboxSnapshot)
        )
        if spec is None or extensions or not poolable or current_group() is not None:
            return await operation()
        started = time.perf_counter()
        await anyio.lowlevel.checkpoint()  # the only await of a hit, before the take: a cancel loses nothing
        pool = self._pool(spec, snapshot)
        self._start()
        handle = self._take(pool) if pool is not None else None
        while handle is None and pool is not None and pool.creating > pool.waiting:
            # A refill of this key is on its way and nobody claimed it: wait for it rather than start
            # one more (under a held cap, a second start could wait behind the pool's own sandboxes).
            pool.waiting += 1
            try:
                if pool.landed is None:
                    pool.landed = anyio.Event()
                await pool.landed.wait()
            finally:
                pool.waiting -= 1
            handle = self._take(pool)
        if handle is None:
            handle = cast("SandboxHandle", await operation())
            self._record("handout", started, "miss")
        else:
            self._record("handout", started, "hit")
        return cast("T", handle)

    def _take(self, pool: _Pool) -> SandboxHandle | None:
        """The oldest ready sandbox young enough to hand out; older ones go to the refill task to close."""
        while pool.ready:
            created, handle = pool.ready.popleft()
            self._record("ready", -1)
            self._notify()
            if self.max_age_s is None or time.monotonic() - created <= self.max_age_s:
                return handle
            self._aged.append(handle)
        return None

    # -- the refill task ------------------------------------------------------------------------

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _start(self) -> None:
        """Start the refill task once, on the event loop of the first create (asyncio or trio)."""
        if self._running or self._draining:
            return
        self._running = True
        self._wake = anyio.Event()
        self._stopped = anyio.Event()
        _spawn_system_task(self._refill_task, self._tasks)

    async def _refill_task(self) -> None:
        assert self._stopped is not None
        try:
            async with anyio.create_task_group() as tg:
                while not self._draining:
                    self._schedule(tg)
                    self._wake = anyio.Event()
                    with anyio.move_on_after(self._next_deadline()):
                        await self._wake.wait()
            # every refill in flight has finished (each is shielded and bounded)
        except Exception as exc:  # pragma: no cover - a bug here must not end the event loop (trio)
            logger.error("warm pool refill task failed: %r", exc, exc_info=exc)
        finally:
            self._stopped.set()

    def _schedule(self, tg: anyio.abc.TaskGroup) -> None:
        now = time.monotonic()
        for handle in self._aged:
            tg.start_soon(self._discard, handle, "max_age")
        self._aged.clear()
        for pool in self._pools.values():
            if self.max_age_s is not None:
                while pool.ready and now - pool.ready[0][0] > self.max_age_s:
                    _, handle = pool.ready.popleft()
                    self._record("ready", -1)
                    tg.start_soon(self._discard, handle, "max_age")
            while (
                len(pool.ready) + pool.creating < self.size
                and self._creating < self.refill_concurrency
                and pool.retry_at <= now
            ):
                pool.creating += 1
                self._creating += 1
                tg.start_soon(self._refill, pool)

    def _next_deadline(self) -> float:
        """Seconds until the refill task must look again without being woken (an age limit, a backoff)."""
        now, soonest = time.monotonic(), math.inf
        for pool in self._pools.values():
            if pool.retry_at > now:
                soonest = min(soonest, pool.retry_at - now)
            if self.max_age_s is not None and pool.ready:
                soonest = min(soonest, pool.ready[0][0] + self.max_age_s - now)
        return max(soonest, 0.01)

    async def _refill(self, pool: _Pool) -> None:
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(self.create_timeout_s):
                if pool.snapshot is None:
                    handle = await self.inner.create(pool.spec)
                else:
                    handle = await self.inner.create(pool.spec, from_snapshot=pool.snapshot)  # type: ignore[call-arg]
        except SandboxSnapshotNotFoundError:
            self._forget(pool)  # its snapshot is gone: no fork of it can be made again
            return
        except Exception as exc:
            pool.failures += 1
            delay = min(_BACKOFF_S[0] * 2 ** (pool.failures - 1), _BACKOFF_S[1])
            pool.retry_at = time.monotonic() + delay
            if pool.failures == 1:
                logger.warning("warm pool: a refill of %s failed, backing off %.1fs: %r", self.name, delay, exc)
            return
        finally:
            pool.creating -= 1
            self._creating -= 1
            self._notify()
            if pool.landed is not None:
                pool.landed.set()
                pool.landed = None
        pool.failures = 0
        if self._draining or pool.removed:
            await self._discard(handle, "drain" if self._draining else "snapshot_deleted")
            return
        pool.ready.append((time.monotonic(), handle))
        self._record("ready", 1)
        if self._refilled is not None:
            self._refilled.set()

    async def _discard(self, handle: SandboxHandle, reason: str) -> None:
        try:
            await close_shielded(self.inner, handle, self.close_timeout_s)
        except Exception as exc:  # still held below: the accounting layer names it at aclose
            logger.warning("warm pool: could not close pooled sandbox %s: %r", handle.sandbox_id, exc)
        else:
            self._record("recycled", reason)

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        try:
            await cast("SupportsSandboxSnapshot", self.inner).delete_snapshot(snapshot)
        except SandboxSnapshotNotFoundError:
            await self._drain_forks_of(snapshot)  # gone already: its forks can be refilled no more
            raise
        await self._drain_forks_of(snapshot)

    async def _drain_forks_of(self, snapshot: SandboxSnapshot) -> None:
        """Remove the pools of ``snapshot`` (this very descriptor) and close their ready forks."""
        wanted = _canonical(snapshot)
        pools = [pool for key, pool in self._pools.items() if pool.snapshot is not None and key[-1] == wanted]
        for pool in pools:
            self._forget(pool)
        await self._close_ready(pools, reason="snapshot_deleted")

    def _forget(self, pool: _Pool) -> None:
        """No more refills or hand-outs of ``pool`` (a pool of forks whose snapshot is gone)."""
        pool.removed = True
        key = spec_key(pool.spec, pool.snapshot)
        if self._pools.get(key) is pool:  # not a pool made since for the same key
            del self._pools[key]
        if self._refilled is not None:
            self._refilled.set()  # wait_ready waits for this pool no more

    async def aclose(self) -> None:
        self._draining = True
        self._notify()
        try:
            with anyio.CancelScope(shield=True):
                # The ready ones first: closing them frees their slots in an admission layer below,
                # where refills in flight may be waiting; those finish and are closed as they land.
                await self._close_all(reason="drain")
                if self._running and self._stopped is not None:
                    with anyio.move_on_after(self.create_timeout_s):
                        await self._stopped.wait()
                await self._close_all(reason="drain")
        finally:
            await self.inner.aclose()

    async def _close_all(self, *, reason: str) -> None:
        aged, self._aged = self._aged, []
        await self._close_ready(list(self._pools.values()), reason=reason, also=aged)

    async def _close_ready(self, pools: list[_Pool], *, reason: str, also: Sequence[SandboxHandle] = ()) -> None:
        """Close the ready sandboxes of ``pools`` (and ``also``), shielded, concurrently."""
        leftover = [handle for pool in pools for _, handle in pool.ready] + list(also)
        for pool in pools:
            if pool.ready:
                self._record("ready", -len(pool.ready))
                pool.ready.clear()
        async with anyio.create_task_group() as tg:
            for handle in leftover:
                tg.start_soon(self._discard, handle, reason)


def _spawn_system_task(run: Callable[[], Awaitable[None]], tasks: set[asyncio.Task[None]]) -> None:
    """Run ``run`` as a task of its own on the current event loop, outliving the calling task."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        import trio

        trio.lowlevel.spawn_system_task(run)
        return
    task = loop.create_task(cast("Any", run()), context=contextvars.Context())  # as trio's: nothing inherited
    tasks.add(task)  # the loop keeps only a weak reference
    task.add_done_callback(tasks.discard)
