"""Per-exec overhead of the full recommended stack, each beside its floor measured in the same run.

Run: python bench/stack_overhead.py

- Without an SDK (the global API providers untouched), the floor is four bare pass-through layers
  (``ProviderMiddleware``) around the same no-op provider: the stack should cost next to nothing
  beyond the layering itself.
- With an SDK (batch span processor, in-memory metric reader), the floor is what OpenTelemetry
  itself costs for the telemetry one exec produces: one SDK span with the same attributes, made
  current the idiomatic way (``start_as_current_span``), plus the histogram record, around the
  same no-op exec.

Goal: each ratio at most 1.3x. Also printed: the stack's overhead as a fraction of one real
``LocalProvider`` exec of ``true``.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from sandbox_middleware import (
    LocalProvider,
    ProviderMiddleware,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    recommended_middleware,
    stack,
)
from sandbox_middleware._telemetry import PROVIDER_ATTR, SANDBOX_DURATION_BOUNDARIES_MS, SANDBOX_ID_ATTR

CALLS = 2_000
ROUNDS = 60
RESULT = SandboxExecResult("", "", 0)


class NoOpProvider:
    """An in-process provider whose operations return at once."""

    name = "noop"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        return SandboxHandle("noop-0", self.name)

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> SandboxExecResult:
        return RESULT

    async def upload_file(self, *args: Any) -> None: ...

    async def download_file(self, *args: Any) -> None: ...

    async def status(self, handle: SandboxHandle) -> Any: ...

    async def close(self, handle: SandboxHandle) -> None: ...

    async def aclose(self) -> None: ...


class DropExporter(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def full_stack(inner: SandboxProvider, **telemetry: Any) -> SandboxProvider:
    return stack(inner, recommended_middleware(**telemetry))


async def per_call_us(*calls: Callable[[], Awaitable[Any]], count: int = CALLS, rounds: int = ROUNDS) -> list[float]:
    """Microseconds per call of each of ``calls``: best of ``rounds``, the calls interleaved round by
    round so that drift in the machine's speed hits all of them alike."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for index, call in enumerate(calls):
            gc.collect()
            started = time.perf_counter()
            for _ in range(count):
                await call()
            best[index] = min(best[index], (time.perf_counter() - started) / count)
    return [value * 1e6 for value in best]


async def main() -> int:
    handle = SandboxHandle("noop-0", "noop")
    noop = NoOpProvider()

    bare: SandboxProvider = noop
    for _ in range(4):
        bare = ProviderMiddleware(bare)
    no_sdk = full_stack(noop)
    floor_no_sdk, stack_no_sdk, direct = await per_call_us(
        lambda: bare.exec(handle, "true"), lambda: no_sdk.exec(handle, "true"), lambda: noop.exec(handle, "true")
    )

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropExporter(), max_queue_size=100_000))
    with_sdk = full_stack(noop, meter_provider=meter_provider, tracer_provider=tracer_provider)

    tracer = tracer_provider.get_tracer("floor")
    histogram = meter_provider.get_meter("floor").create_histogram(
        "floor.exec_duration_ms", unit="ms", explicit_bucket_boundaries_advisory=list(SANDBOX_DURATION_BOUNDARIES_MS)
    )
    attributes = {PROVIDER_ATTR: "noop"}

    async def floor_exec() -> SandboxExecResult:
        # OpenTelemetry's own idiom for a span around an operation (current while it runs, so a
        # provider's own instrumented calls nest under it), plus the histogram record.
        with tracer.start_as_current_span(
            "gym.sandbox.exec", attributes={PROVIDER_ATTR: "noop", SANDBOX_ID_ATTR: "noop-0"}
        ) as span:
            started = time.perf_counter()
            result = await noop.exec(handle, "true")
            histogram.record((time.perf_counter() - started) * 1000.0, attributes)
            span.set_attribute("nemo.gym.sandbox.return_code", result.return_code)
        return result

    async def bare_span_exec() -> SandboxExecResult:
        # The least a span can cost: started and ended, never made current.
        span = tracer.start_span("gym.sandbox.exec", attributes={PROVIDER_ATTR: "noop", SANDBOX_ID_ATTR: "noop-0"})
        started = time.perf_counter()
        result = await noop.exec(handle, "true")
        histogram.record((time.perf_counter() - started) * 1000.0, attributes)
        span.set_attribute("nemo.gym.sandbox.return_code", result.return_code)
        span.end()
        return result

    floor_sdk, bare_sdk, stack_sdk = await per_call_us(
        floor_exec, bare_span_exec, lambda: with_sdk.exec(handle, "true"), rounds=30
    )
    tracer_provider.shutdown()
    meter_provider.shutdown()

    local = LocalProvider()
    box = await local.create(SandboxSpec())
    [real_exec] = await per_call_us(lambda: local.exec(box, "true"), count=50, rounds=3)
    await local.close(box)

    no_sdk_overhead = stack_no_sdk - direct
    sdk_overhead = stack_sdk - direct
    print(f"no-op exec, called directly:          {direct:7.2f} us")
    print(
        f"without SDK: full stack               {stack_no_sdk:7.2f} us   floor (4 bare layers) {floor_no_sdk:7.2f} us"
        f"   ratio {stack_no_sdk / floor_no_sdk:.2f}x (goal <= 1.30x)"
    )
    print(
        f"with SDK:    full stack               {stack_sdk:7.2f} us   floor (1 span + metrics)  {floor_sdk:7.2f} us"
        f"   ratio {stack_sdk / floor_sdk:.2f}x (goal <= 1.30x)"
    )
    print(
        f"             (a span never made current, the least a span costs: {bare_sdk:.2f} us, "
        f"ratio {stack_sdk / bare_sdk:.2f}x)"
    )
    print(f"real LocalProvider exec of `true`:    {real_exec:7.0f} us")
    print(
        f"stack overhead / real exec:           without SDK {no_sdk_overhead / real_exec:.4%}, "
        f"with SDK {sdk_overhead / real_exec:.4%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
