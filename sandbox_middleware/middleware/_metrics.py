"""``MetricsMiddleware``: startup and exec durations as histograms, failures as a counter."""

from __future__ import annotations

import time
from typing import TypeVar

from opentelemetry.metrics import Counter, Histogram, MeterProvider

from .._core import Operation, ProviderMiddleware
from .._protocol import SandboxProvider
from .._telemetry import (
    ERROR_TYPE_ATTR,
    OPERATION_ATTR,
    PROVIDER_ATTR,
    SANDBOX_DURATION_BOUNDARIES_MS,
    InstrumentBundle,
    Instruments,
    counter,
    duration_ms,
    error_type,
    global_gate,
    safely,
)

__all__ = ["MetricsMiddleware"]

T = TypeVar("T")

# The operations whose successful calls are timed: (instrument, its name).
_DURATIONS = {
    "create": ("startup", "gym.sandbox.startup_duration_ms"),
    "exec": ("exec", "gym.sandbox.exec_duration_ms"),
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


class MetricsMiddleware(ProviderMiddleware):
    """Records ``gym.sandbox.startup_duration_ms`` per successful create, ``gym.sandbox.exec_duration_ms``
    per exec that returned a result, and ``gym.sandbox.failure_total`` per operation that raised.

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

    async def around(self, operation: Operation[T]) -> T:
        started = time.perf_counter()
        try:
            result = await operation()
        except Exception as exc:
            self._failed(operation.name, exc)
            raise
        duration = _DURATIONS.get(operation.name)
        if duration is not None:
            instruments = self._instruments.get()
            if instruments is not None:
                field, what = duration
                self._duration(getattr(instruments, field), started, what)
        return result
