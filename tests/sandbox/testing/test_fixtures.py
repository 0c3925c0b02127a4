"""The public test helpers, used the way a user would test their own middleware."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sandbox_middleware import ProviderMiddleware, ReleaseAccountingMiddleware, SandboxHandle, SandboxSpec
from sandbox_middleware.testing import FaultInjectingProvider

pytestmark = pytest.mark.anyio


class CountsExecs(ProviderMiddleware):
    """A user's own middleware: counts execs on a counter of its own."""

    def __init__(self, inner: Any, *, meter_provider: MeterProvider) -> None:
        super().__init__(inner)
        self.counter = meter_provider.get_meter("mine").create_counter("my.exec_total")

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> Any:
        self.counter.add(1)
        return await super().exec(handle, command, **kwargs)


async def test_a_user_middleware_in_a_few_lines(
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
) -> None:
    """The named fixtures give an in-memory SDK to test one's own middleware against."""
    provider = CountsExecs(FaultInjectingProvider(), meter_provider=meter_provider)
    handle = await provider.create(SandboxSpec())
    with tracer_provider.get_tracer("test").start_as_current_span("rollout"):
        await provider.exec(handle, "true")
        await provider.exec(handle, "true")
    data = metric_reader.get_metrics_data()
    assert data is not None
    [metric] = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert metric.name == "my.exec_total" and metric.data.data_points[0].value == 2
    assert [span.name for span in span_exporter.get_finished_spans()] == ["rollout"]


async def test_ten_thousand_held_sandboxes_cost_well_under_10_mb() -> None:
    """The ledger's memory for 10,000 held sandboxes (handles included) stays well under 10 MB."""
    accounting = ReleaseAccountingMiddleware(FaultInjectingProvider())
    await accounting.create(SandboxSpec())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            await accounting.create(SandboxSpec())
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(accounting.held()) == 10_001
    assert grown < 10 * 2**20 / 2, f"{grown / 2**20:.1f} MiB"
