"""The ``run`` command's telemetry: SDK providers of its own, the table's reader, and the exporters.

Nothing is installed globally. Shutting down is bounded in time, and a collector that could not be
reached is reported once, in one line, instead of the exporters' own per-attempt log lines.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider

from .._errors import UsageError

__all__ = ["EXPORTS", "SHUTDOWN_TIMEOUT_S", "Telemetry", "start_telemetry"]

EXPORTS = ("none", "console", "otlp", "prometheus")
SHUTDOWN_TIMEOUT_S = 5.0
"""How long the exporters get to deliver what is left when the run ends."""
OTLP_EXPORT_TIMEOUT_S = 4.0
"""Each OTLP export, retries included (unless OTEL_EXPORTER_OTLP_TIMEOUT says otherwise)."""
_OTLP_LOGGERS = ("opentelemetry.exporter.otlp",)


@dataclass
class _FailedExports:
    """Exports an exporter reported as failed, counted instead of logged one by one."""

    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, result: Any) -> Any:
        if getattr(result, "name", "SUCCESS") != "SUCCESS":
            with self.lock:
                self.count += 1
        return result


@dataclass
class Telemetry:
    """The run's meter and tracer providers, the reader the table is computed from, and how to stop."""

    meter_provider: MeterProvider
    tracer_provider: TracerProvider
    table_reader: InMemoryMetricReader
    closers: list[Callable[[], None]] = field(default_factory=list)
    failed_exports: _FailedExports | None = None
    destination: str = ""
    metrics_port: int | None = None
    """The port /metrics is served on (--export prometheus)."""

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> list[str]:
        """Flush and stop everything at once, within ``timeout_s``; return what the operator should be told."""
        deadline = time.monotonic() + timeout_s
        workers = [
            threading.Thread(target=_quietly, args=(stop,), name="telemetry-shutdown", daemon=True)
            for stop in (self.meter_provider.shutdown, self.tracer_provider.shutdown, *self.closers)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        notes = []
        if any(worker.is_alive() for worker in workers):
            notes.append(f"telemetry: exporters did not finish within {timeout_s:g} s; the rest was dropped")
        if self.failed_exports is not None and self.failed_exports.count:
            notes.append(
                f"telemetry: the collector at {self.destination} was unreachable or refused the data: "
                f"{self.failed_exports.count} export(s) failed (set OTEL_EXPORTER_OTLP_ENDPOINT)"
            )
        return notes


def _quietly(stop: Callable[[], object]) -> None:
    try:
        stop()
    except Exception as exc:  # one exporter's failure must not keep the others from stopping
        print(f"telemetry: shutting down failed: {exc!r}", file=sys.stderr)


def start_telemetry(export: str, prometheus_host: str, prometheus_port: int) -> Telemetry:
    """Providers for one run with the table's in-memory reader and the exporter ``export`` names."""
    table_reader = InMemoryMetricReader()
    readers: list[Any] = [table_reader]
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    telemetry_args: dict[str, Any] = {}
    if export == "console":
        # One compact line per export on stderr: stdout carries only the table.
        exporter = ConsoleMetricExporter(out=sys.stderr, formatter=lambda data: data.to_json(indent=None) + "\n")
        readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=60_000))
    elif export == "otlp":
        telemetry_args = _otlp(readers, tracer_provider)
    elif export == "prometheus":
        telemetry_args = _prometheus(readers, prometheus_host, prometheus_port)
    meter_provider = MeterProvider(metric_readers=readers, shutdown_on_exit=False)
    return Telemetry(meter_provider, tracer_provider, table_reader, **telemetry_args)


def _otlp(readers: list[Any], tracer_provider: TracerProvider) -> dict[str, Any]:
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise UsageError(_missing_extra("otlp", exc)) from exc
    failed = _FailedExports()

    class CountingMetricExporter(OTLPMetricExporter):  # type: ignore[misc,unused-ignore]  # Any without the extra
        def export(self, *args: Any, **kwargs: Any) -> Any:
            return failed.record(super().export(*args, **kwargs))

    class CountingSpanExporter(OTLPSpanExporter):  # type: ignore[misc,unused-ignore]
        def export(self, *args: Any, **kwargs: Any) -> Any:
            return failed.record(super().export(*args, **kwargs))

    for name in _OTLP_LOGGERS:  # their per-attempt warnings become the one line shutdown() returns
        logging.getLogger(name).setLevel(logging.CRITICAL)
    timeout = None if "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ else OTLP_EXPORT_TIMEOUT_S
    readers.append(PeriodicExportingMetricReader(CountingMetricExporter(timeout=timeout)))
    tracer_provider.add_span_processor(BatchSpanProcessor(CountingSpanExporter(timeout=timeout)))
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    return {"failed_exports": failed, "destination": _without_credentials(endpoint)}


def _without_credentials(url: str) -> str:
    """``url`` as it may be printed: a user or password in it becomes ``***``."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _prometheus(readers: list[Any], host: str, port: int) -> dict[str, Any]:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise UsageError(_missing_extra("prometheus", exc)) from exc
    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as exc:
        argument = (
            "--prometheus-host"
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            else ("--prometheus-port")
        )
        raise UsageError(
            f"argument {argument}: cannot serve /metrics on {host}:{port}: {exc.strerror or exc}; "
            f"choose another {argument.removeprefix('--prometheus-')}"
        ) from exc
    readers.append(PrometheusMetricReader())
    port = server.server_port  # the port chosen when 0 asked for a free one
    print(f"serving /metrics on http://{host}:{port}/metrics", file=sys.stderr)

    def stop_serving() -> None:
        server.shutdown()
        server.server_close()

    return {"closers": [stop_serving], "metrics_port": port}


def _missing_extra(name: str, exc: ImportError) -> str:
    return (
        f"argument --export: --export {name} needs the '{name}' extra ({exc.name} is not installed): "
        f"pip install 'llm-sandbox-middleware[{name}]'"
    )
