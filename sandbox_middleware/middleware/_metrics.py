"""``MetricsMiddleware``: startup, exec and snapshot durations as histograms, failures and forks as counters."""

from __future__ import annotations

import builtins
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar, cast

from opentelemetry.metrics import Counter, Histogram, MeterProvider

from .._core import Operation, ProviderMiddleware
from .._protocol import SandboxHandle, SandboxProvider, SandboxSnapshot, SupportsSandboxSnapshot
from .._telemetry import (
    ERROR_TYPE_ATTR,
    OPERATION_ATTR,
    PROVIDER_ATTR,
    SANDBOX_DURATION_BOUNDARIES_MS,
    SNAPSHOT_SIZE_BOUNDARIES_BYTES,
    InstrumentBundle,
    Instruments,
    counter,
    duration_ms,
    error_type,
    global_gate,
    safely,
    size_bytes,
)

__all__ = ["MetricsMiddleware"]

T = TypeVar("T")

# The operations whose successful calls are timed: (instrument, its name).
_DURATIONS = {
    "create": ("startup", "gym.sandbox.startup_duration_ms"),
    "exec": ("exec", "gym.sandbox.exec_duration_ms"),
    "snapshot": ("snapshot", "gym.sandbox.snapshot.duration_ms"),
}


class _Instruments(InstrumentBundle):
    startup: Histogram = duration_ms(
        "gym.sandbox.startup_duration_ms", "Wall-clock time to provision one sandbox.", SANDBOX_DURATION_BOUNDARIES_MS
    )
    exec: Histogram = duration_ms(
        "gym.sandbox.exec_duration_ms",
        "Wall-clock time to run one command inside a sandbox.",
        SANDBOX_DURATION_BOUNDARIES_MS,
    )
    failures: Counter = counter(
        "gym.sandbox.failure_total", "{failure}", "Sandbox operations that raised, by operation and error type."
    )
    snapshot: Histogram = duration_ms(
        "gym.sandbox.snapshot.duration_ms",
        "Wall-clock time to take one snapshot of a sandbox's filesystem.",
        SANDBOX_DURATION_BOUNDARIES_MS,
    )
    snapshot_size: Histogram = size_bytes(
        "gym.sandbox.snapshot.size_bytes", "What one snapshot holds (its files' sizes).", SNAPSHOT_SIZE_BOUNDARIES_BYTES
    )
    forks: Counter = counter(
        "gym.sandbox.snapshot.fork_total",
        "{sandbox}",
        "Sandboxes created from a snapshot (creates with from_snapshot).",
    )


class MetricsMiddleware(ProviderMiddleware):
    """Records ``gym.sandbox.startup_duration_ms`` per successful create, ``gym.sandbox.exec_duration_ms``
    per exec that returned a result, and ``gym.sandbox.failure_total`` per operation that raised.

    Where the provider takes snapshots: ``gym.sandbox.snapshot.duration_ms`` and
    ``gym.sandbox.snapshot.size_bytes`` per snapshot taken, ``gym.sandbox.snapshot.fork_total`` per
    successful create from a snapshot (timed as a start like any create), and failures of
    ``snapshot`` and ``delete_snapshot`` in ``failure_total`` under those operation names.

    A failure is not a latency: an operation that raised records no duration. Every point carries
    ``nemo.gym.sandbox.provider``. Without an SDK nothing is recorded; a failing instrument is
    logged once and never reaches the caller.
    """

    def __init__(self, inner: SandboxProvider, *, meter_provider: MeterProvider | None = None) -> None:
        super().__init__(inner)
        self._instruments = Instruments(_Instruments.create, meter_provider)
        # Without an SDK nothing is recorded: no operation is wrapped.
        self._gate = global_gate("metrics", meter_provider, self._instruments)
        self._attributes = {PROVIDER_ATTR: inner.name}

    def _failed(self, operation: str, exc: Exception) -> None:
        instruments = self._instruments.get()
        if instruments is None:
            return
        attributes = {PROVIDER_ATTR: self.name, OPERATION_ATTR: operation, ERROR_TYPE_ATTR: error_type(exc)}
        safely("gym.sandbox.failure_total", instruments.failures.add, 1, attributes)

    def _duration(self, histogram: Histogram, started: float, what: str) -> None:
        safely(what, histogram.record, (time.perf_counter() - started) * 1000.0, self._attributes)

    def around(self, operation: Operation[T]) -> Coroutine[Any, Any, T]:  # no frame of its own: exec is hot
        source = operation.extensions.get("from_snapshot") if operation.name == "create" else None
        return self._measured(operation.name, operation, source)

    async def _measured(self, name: str, call: Callable[[], Awaitable[T]], source: object = None) -> T:
        """``call()``, the operation ``name``: its failure counted, its duration (and what else it
        tells) recorded."""
        started = time.perf_counter()
        try:
            result = await call()
        except Exception as exc:
            self._failed(name, exc)
            raise
        duration = _DURATIONS.get(name)
        instruments = self._instruments.get() if duration is not None else None
        if duration is not None and instruments is not None:
            field, what = duration
            self._duration(getattr(instruments, field), started, what)
            if isinstance(result, SandboxSnapshot):
                what = "gym.sandbox.snapshot.size_bytes"
                safely(what, instruments.snapshot_size.record, result.size_bytes, self._attributes)
            elif source is not None:
                safely("gym.sandbox.snapshot.fork_total", instruments.forks.add, 1, self._attributes)
        return result

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        inner = cast("SupportsSandboxSnapshot", self.inner)
        if self._gate.get() is None:
            return await inner.snapshot(handle, paths=paths, metadata=metadata)
        return await self._measured("snapshot", lambda: inner.snapshot(handle, paths=paths, metadata=metadata))

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        inner = cast("SupportsSandboxSnapshot", self.inner)
        if self._gate.get() is None:
            return await inner.delete_snapshot(snapshot)
        return await self._measured("delete_snapshot", lambda: inner.delete_snapshot(snapshot))
