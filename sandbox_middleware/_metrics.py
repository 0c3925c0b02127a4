"""``MetricsMiddleware``: startup and exec durations as histograms, failures as a counter."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry.metrics import Counter, Histogram, Meter, MeterProvider

from ._core import ProviderMiddleware
from ._protocol import SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSpec, SandboxStatus
from ._telemetry import (
    ERROR_TYPE_ATTR,
    OPERATION_ATTR,
    PROVIDER_ATTR,
    SANDBOX_DURATION_BOUNDARIES_MS,
    Instruments,
    error_type,
    safely,
)

__all__ = ["MetricsMiddleware"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Instruments:
    startup: Histogram
    exec: Histogram
    failures: Counter

    @classmethod
    def create(cls, meter: Meter) -> _Instruments:
        return cls(
            startup=meter.create_histogram(
                "gym.sandbox.startup_duration_ms",
                unit="ms",
                description="Wall-clock time to provision one sandbox.",
                explicit_bucket_boundaries_advisory=list(SANDBOX_DURATION_BOUNDARIES_MS),
            ),
            exec=meter.create_histogram(
                "gym.sandbox.exec_duration_ms",
                unit="ms",
                description="Wall-clock time to run one command inside a sandbox.",
                explicit_bucket_boundaries_advisory=list(SANDBOX_DURATION_BOUNDARIES_MS),
            ),
            failures=meter.create_counter(
                "gym.sandbox.failure_total",
                unit="{failure}",
                description="Sandbox operations that raised, by operation and error type.",
            ),
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
        self._attributes = {PROVIDER_ATTR: inner.name}

    def _failed(self, operation: str, exc: Exception) -> None:
        instruments = self._instruments.get()
        if instruments is None:
            return
        attributes = {PROVIDER_ATTR: self.name, OPERATION_ATTR: operation, ERROR_TYPE_ATTR: error_type(exc)}
        safely("gym.sandbox.failure_total", instruments.failures.add, 1, attributes)

    def _duration(self, histogram: Histogram, started: float, what: str) -> None:
        safely(what, histogram.record, (time.perf_counter() - started) * 1000.0, self._attributes)

    async def _counting(self, operation: str, call: Awaitable[T]) -> T:
        """Await ``call``; if it raises, count the failure under ``operation`` and re-raise."""
        try:
            return await call
        except Exception as exc:
            self._failed(operation, exc)
            raise

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        started = time.perf_counter()
        handle = await self._counting("create", self.inner.create(spec, **extensions))
        instruments = self._instruments.get()
        if instruments is not None:
            self._duration(instruments.startup, started, "gym.sandbox.startup_duration_ms")
        return handle

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
        **extensions: Any,
    ) -> SandboxExecResult:
        call = self._inner_exec(handle, command, cwd, env, timeout_s, user, extensions)
        instruments = self._instruments.get()
        if instruments is None:
            return await call
        started = time.perf_counter()
        result = await self._counting("exec", call)
        self._duration(instruments.exec, started, "gym.sandbox.exec_duration_ms")
        return result

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str, **extensions: Any) -> None:
        await self._counting("upload", self.inner.upload_file(handle, source_path, target_path, **extensions))

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path, **extensions: Any
    ) -> None:
        await self._counting("download", self.inner.download_file(handle, source_path, target_path, **extensions))

    async def status(self, handle: SandboxHandle, **extensions: Any) -> SandboxStatus:
        return await self._counting("status", self.inner.status(handle, **extensions))

    async def close(self, handle: SandboxHandle, **extensions: Any) -> None:
        await self._counting("close", self.inner.close(handle, **extensions))
