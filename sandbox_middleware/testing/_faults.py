"""``FaultInjectingProvider``: an in-process provider that fails, lags and hangs on request."""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio

from .._core import OPERATIONS as OPERATIONS  # re-exported by sandbox_middleware.testing
from .._core import Operation, ProviderMiddleware
from .._errors import InjectedCreateError, InjectedFault, SandboxNotFoundError
from .._protocol import SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSpec, SandboxStatus

T = TypeVar("T")

_ON_A_LIVE_SANDBOX = frozenset({"exec", "upload", "download"})
"""The operations that fail with SandboxNotFoundError on a sandbox that is not alive."""

FAULT_STREAM: ContextVar[str] = ContextVar("sandbox_middleware_fault_stream", default="")
"""The stream of random choices the calls of this context draw from (``sandbox-middleware run`` sets
``"session N"`` in each session): with one stream per session, which faults land on a session depends on
the seed and the session alone, never on which of the sessions running at once called first."""


class FaultInjectingProvider(ProviderMiddleware):
    """A provider whose sandboxes are entries in a set, with faults injected on request.

    - ``failure_rates``: probability per operation (create, exec, upload, download, status,
      close) that the call raises ``InjectedFault`` (``InjectedCreateError`` for create) before
      it has any effect.
    - ``lost_create_rate``: probability that create really creates the sandbox and then raises
      (the response was lost): the sandbox exists but nobody holds its handle.
    - ``close_failures``: each sandbox's first N closes raise, the next one succeeds.
    - ``latency``: seconds each operation waits (anyio.sleep) before its effect.
    - ``hang_at``: await points, ``"operation:before"`` or ``"operation:after"`` (after the
      effect), where the call waits forever, so the caller's cancel scope cancels it right there.

    With ``inner`` (a real provider) the effects happen there and the faults are injected in front
    of it (``sandbox-middleware run --faults``); without it sandboxes are entries in a set.

    Ground truth: ``alive`` is the set of sandbox ids that really exist, ``orphaned`` those created
    by a lost or cancelled create whose handle never reached the caller, ``injected`` every fault
    raised. ``seed`` makes the random choices reproducible: the n-th call of an operation in a stream
    (``FAULT_STREAM``; a call on a sandbox outside any stream draws from the stream that created it) is
    failed or not by ``(seed, stream, operation, n)`` alone, whatever else runs at the same time.
    """

    def __init__(
        self,
        inner: SandboxProvider | None = None,
        *,
        name: str = "faulty",
        seed: int = 0,
        failure_rates: Mapping[str, float] | None = None,
        lost_create_rate: float = 0.0,
        close_failures: int = 0,
        latency: Mapping[str, float] | None = None,
        hang_at: Collection[str] = (),
    ) -> None:
        rates = dict(failure_rates or {})
        unknown = set(rates) | set(latency or {}) | {point.split(":")[0] for point in hang_at}
        unknown -= set(OPERATIONS)
        if unknown:
            raise ValueError(f"FaultInjectingProvider: unknown operation(s) {sorted(unknown)}; use {OPERATIONS}")
        for operation, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(
                    f"FaultInjectingProvider: failure rate for {operation!r} must be in [0, 1], not {rate}"
                )
        self.alive: set[str] = set()
        # With inner, its optional capabilities (list, connect ...) pass through; without, sandboxes are ids in alive.
        super().__init__(inner if inner is not None else _Sandboxes(name, self.alive))
        self.failure_rates = rates
        self.lost_create_rate = lost_create_rate
        self.close_failures = close_failures
        self.latency = dict(latency or {})
        self.hang_at = frozenset(hang_at)
        self.seed = seed
        self._draws: dict[tuple[str, str], int] = {}  # (stream, operation): calls so far
        self._streams: dict[str, str] = {}  # sandbox id: the stream of the create that made it
        self.orphaned: set[str] = set()
        self.injected: list[InjectedFault] = []
        self.calls: dict[str, int] = dict.fromkeys(OPERATIONS, 0)
        self._close_attempts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"FaultInjectingProvider(name={self.name!r}, alive={len(self.alive)})"

    async def _enter(self, operation: str, sandbox_id: str | None) -> None:
        """The 'before' await point: latency, hang, injected failure, liveness."""
        self.calls[operation] += 1
        delay = self.latency.get(operation)
        if delay:
            await anyio.sleep(delay)
        else:
            await anyio.lowlevel.checkpoint()
        if f"{operation}:before" in self.hang_at:
            await anyio.sleep_forever()
        rate = self.failure_rates.get(operation)
        if rate and self._chance(operation, sandbox_id) < rate:
            self._raise(operation, f"injected {operation} failure")
        if operation in _ON_A_LIVE_SANDBOX and sandbox_id is not None and sandbox_id not in self.alive:
            raise SandboxNotFoundError(f"{self.name}: no live sandbox {sandbox_id!r}")

    async def _leave(self, operation: str) -> None:
        """The 'after' await point, once the operation took effect."""
        if f"{operation}:after" in self.hang_at:
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()

    def _chance(self, draw: str, sandbox_id: str | None) -> float:
        """The next random number of ``draw`` (an operation, or ``lost_create``) in this call's stream."""
        stream = FAULT_STREAM.get() or self._streams.get(sandbox_id or "", "")
        n = self._draws.get((stream, draw), 0)
        self._draws[(stream, draw)] = n + 1
        return random.Random(f"{self.seed}/{stream}/{draw}/{n}").random()

    def _raise(self, operation: str, message: str) -> None:
        error = InjectedCreateError(message) if operation == "create" else InjectedFault(message)
        self.injected.append(error)
        raise error

    async def around(self, operation: Operation[T]) -> T:
        name, handle = operation.name, operation.handle
        sandbox_id = handle.sandbox_id if handle is not None else None
        await self._enter(name, sandbox_id)
        if handle is not None and name == "close":
            attempts = self._close_attempts.get(handle.sandbox_id, 0)
            if attempts < self.close_failures and handle.sandbox_id in self.alive:
                self._close_attempts[handle.sandbox_id] = attempts + 1
                self._raise("close", f"injected close failure {attempts + 1}/{self.close_failures}")
        result = await operation()
        created = cast("SandboxHandle", result).sandbox_id if name == "create" else None
        if created is not None:
            self.alive.add(created)
            self.orphaned.add(created)  # until the handle is handed back
            self._streams[created] = FAULT_STREAM.get()
            if self.lost_create_rate and self._chance(LOST_CREATE, None) < self.lost_create_rate:
                self._raise("create", f"injected lost response: {created} was created")
        elif handle is not None and name == "close":
            self._close_attempts.pop(handle.sandbox_id, None)
            self.alive.discard(handle.sandbox_id)
            self._streams.pop(handle.sandbox_id, None)
        await self._leave(name)
        if created is not None:
            self.orphaned.discard(created)
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()
        await anyio.lowlevel.checkpoint()


class _Sandboxes:
    """FaultInjectingProvider's provider when it wraps none: a sandbox is its id in ``alive``
    (the set the fault injector keeps), commands echo."""

    def __init__(self, name: str, alive: set[str]) -> None:
        self.name = name
        self.alive = alive
        self._ids = 0  # an int, not itertools.count: providers pickle (3.14 drops itertools pickling)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        self._ids += 1
        return SandboxHandle(f"{self.name}-{self._ids - 1}", self.name, None)

    async def exec(self, handle: SandboxHandle, command: str, **options: Any) -> SandboxExecResult:
        return SandboxExecResult(f"ran: {command}\n", "", 0)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        pass

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        pass

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus.RUNNING if handle.sandbox_id in self.alive else SandboxStatus.STOPPED

    async def close(self, handle: SandboxHandle) -> None:
        pass

    async def aclose(self) -> None:
        pass


LOST_CREATE = "lost_create"
"""The fault name of ``lost_create_rate`` in ``parse_faults`` (create succeeds, its response is lost)."""


def parse_faults(spec: str) -> dict[str, float]:
    """``"create=0.1,close=0.05,lost_create=0.1"`` as rates; a ``ValueError`` says what is wrong.

    Operation names are failure rates; ``lost_create`` is ``lost_create_rate``.
    """
    rates: dict[str, float] = {}
    names = (*OPERATIONS, LOST_CREATE)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        operation, sep, value = part.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not sep or operation not in names or not 0.0 <= rate <= 1.0:
            raise ValueError(
                f"bad fault {part!r}: use name=probability with name one of {', '.join(names)} "
                "and probability in [0, 1], e.g. create=0.1,close=0.05,lost_create=0.1"
            )
        rates[operation] = rate
    return rates
