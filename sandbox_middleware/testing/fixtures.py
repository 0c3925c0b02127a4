"""Pytest fixtures with an in-memory OpenTelemetry SDK, for testing middleware in a few lines.

Enable with ``pytest_plugins = ["sandbox_middleware.testing.fixtures"]`` (needs ``opentelemetry-sdk``)::

    async def test_my_layer(telemetry):
        provider = MetricsMiddleware(FaultInjectingProvider(), meter_provider=telemetry.meter_provider)
        ...
        assert telemetry.histogram_count("gym.sandbox.startup_duration_ms") == 1

Nothing here touches the global providers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["TelemetryCapture", "meter_provider", "metric_reader", "span_exporter", "telemetry", "tracer_provider"]


class TelemetryCapture:
    """An SDK meter provider and tracer provider that keep everything in memory."""

    def __init__(self) -> None:
        self.metric_reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])
        self.span_exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))

    def points(self, name: str) -> list[Any]:
        """Every data point of the metric ``name`` collected now."""
        data = self.metric_reader.get_metrics_data()
        found: list[Any] = []
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def value(self, name: str, **attributes: Any) -> float:
        """The sum of a counter's points whose attributes include ``attributes`` (dots as ``__``)."""
        wanted = {key.replace("__", "."): value for key, value in attributes.items()}
        return float(
            sum(point.value for point in self.points(name) if wanted.items() <= dict(point.attributes or {}).items())
        )

    def histogram_count(self, name: str, **attributes: Any) -> int:
        """How many samples a histogram holds over points matching ``attributes``."""
        wanted = {key.replace("__", "."): value for key, value in attributes.items()}
        return sum(point.count for point in self.points(name) if wanted.items() <= dict(point.attributes or {}).items())

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, optionally only those called ``name``."""
        return [span for span in self.span_exporter.get_finished_spans() if name is None or span.name == name]

    def shutdown(self) -> None:
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()


@pytest.fixture
def telemetry() -> Iterator[TelemetryCapture]:
    """An in-memory meter provider, tracer provider, metric reader and span exporter."""
    capture = TelemetryCapture()
    yield capture
    capture.shutdown()


@pytest.fixture
def meter_provider(telemetry: TelemetryCapture) -> MeterProvider:
    """The in-memory SDK meter provider (``telemetry.meter_provider``)."""
    return telemetry.meter_provider


@pytest.fixture
def metric_reader(telemetry: TelemetryCapture) -> InMemoryMetricReader:
    """The reader behind ``meter_provider``: ``metric_reader.get_metrics_data()``."""
    return telemetry.metric_reader


@pytest.fixture
def tracer_provider(telemetry: TelemetryCapture) -> TracerProvider:
    """The in-memory SDK tracer provider (``telemetry.tracer_provider``)."""
    return telemetry.tracer_provider


@pytest.fixture
def span_exporter(telemetry: TelemetryCapture) -> InMemorySpanExporter:
    """The exporter behind ``tracer_provider``: ``span_exporter.get_finished_spans()``."""
    return telemetry.span_exporter
