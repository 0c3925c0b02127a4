"""The proxy's telemetry: a span and a duration per proxied call by dialect, capture failures by type.

A call is told once: ``ProxyTelemetry.report`` opens its span (current for the whole call, so the
capture's own spans are its children), hands the stages a ``Report`` to fill as they go (stream or
not, which upstream API, the failure answered), and reads it when the call is over, after its
answer's last byte. Only the OpenTelemetry API, through the lazy never-raising helpers the rest of
``tokens`` uses. Attributes never carry the upstream's URL or credentials, nor request content.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import context, trace
from opentelemetry.metrics import Counter, Histogram, MeterProvider
from opentelemetry.trace import Span, TracerProvider

from _shared_telemetry import (
    ERROR_TYPE_ATTR,
    InstrumentBundle,
    Instruments,
    Tracing,
    counter,
    duration_ms,
    error_type,
    record_error,
    report_once,
    safely,
)

from ._errors import CaptureFailedError, ProxyError, upstream_error

__all__ = [
    "DIALECT_ATTR",
    "OUTCOME_ATTR",
    "STREAM_ATTR",
    "UPSTREAM_ATTR",
    "ProxyInstruments",
    "ProxyTelemetry",
    "Report",
]

SCOPE = "tokens.proxy"

DIALECT_ATTR = "tokens.proxy.dialect"
STREAM_ATTR = "tokens.proxy.stream"
UPSTREAM_ATTR = "tokens.proxy.upstream_api"
OUTCOME_ATTR = "tokens.proxy.outcome"


class ProxyInstruments(InstrumentBundle):
    duration_ms: Histogram = duration_ms(
        "tokens.proxy.duration_ms",
        "Proxied model calls, from the request to the answer's last byte, by dialect and outcome.",
    )
    capture_errors: Counter = counter(
        "tokens.proxy.capture_error_total", "{call}", "Proxied calls whose capture failed, by dialect and error type."
    )


@dataclass
class Report:
    """What one proxied call tells of itself, filled by the stages it goes through and read once, when
    it is over: its dialect, whether it streamed, the upstream API asked (None: none was), the failure
    answered, and what the upstream raised when that failure is the client's view of it."""

    dialect: str
    stream: bool = False
    upstream_api: str | None = None
    error: ProxyError | None = None
    cause: BaseException | None = None


class ProxyTelemetry:
    """What the proxy tells of its calls: a span and a duration each, capture failures counted."""

    def __init__(self, meter_provider: MeterProvider | None, tracer_provider: TracerProvider | None) -> None:
        self.instruments = Instruments(ProxyInstruments.create, meter_provider, SCOPE)
        self.tracing = Tracing(tracer_provider, SCOPE)

    def upstream_error(self, exc: BaseException) -> ProxyError:
        """The client's view of a failure outside a call (``GET /v1/models``); a capture failure is counted."""
        error = upstream_error(exc)
        self._count_capture_error("unknown", error, exc)
        return error

    @contextmanager
    def report(self, dialect: str) -> Iterator[Report]:
        """One proxied call, from its request to its answer's last byte: its span current throughout,
        then its duration, its span's end and any capture failure, from the ``Report`` the stages filled."""
        report = Report(dialect)
        started = time.perf_counter()
        span: Span | None = None
        token: object = None
        tracer = self.tracing.get()
        if tracer is not None:
            try:
                span = tracer.start_span(f"tokens.proxy {dialect}", attributes={DIALECT_ATTR: dialect})
                token = context.attach(trace.set_span_in_context(span))
            except Exception as exc:  # a broken span processor: no span, the call goes on
                report_once("starting span tokens.proxy", exc)
        try:
            yield report
        except Exception as exc:  # not answered by the proxy (the answer could not be sent)
            if span is not None:
                safely("tokens.proxy span", record_error, span, exc)
            raise
        finally:
            if token is not None:
                safely("tokens.proxy span", context.detach, token)
            if span is not None:
                safely("tokens.proxy span", _end_span, span, report)
            self._finished(report, (time.perf_counter() - started) * 1000.0)

    def _finished(self, report: Report, elapsed: float) -> None:
        instruments = self.instruments.get()
        if instruments is not None:
            outcome = "ok" if report.error is None else type(report.error).__name__
            attributes = {DIALECT_ATTR: report.dialect, STREAM_ATTR: report.stream, OUTCOME_ATTR: outcome}
            safely("tokens.proxy.duration_ms", instruments.duration_ms.record, elapsed, attributes)
        if report.error is not None and report.cause is not None:
            self._count_capture_error(report.dialect, report.error, report.cause)

    def _count_capture_error(self, dialect: str, error: ProxyError, exc: BaseException) -> None:
        """Count ``exc`` when the proxy answered it as a capture failure (not a ``ProxyError`` passed on)."""
        if error is exc or not isinstance(error, CaptureFailedError):
            return
        instruments = self.instruments.get()
        if instruments is not None:
            attributes = {DIALECT_ATTR: dialect, ERROR_TYPE_ATTR: error_type(exc)}
            safely("tokens.proxy.capture_error_total", instruments.capture_errors.add, 1, attributes)


def _end_span(span: Span, report: Report) -> None:
    span.set_attribute(STREAM_ATTR, report.stream)
    if report.upstream_api is not None:
        span.set_attribute(UPSTREAM_ATTR, report.upstream_api)
    if report.error is not None:
        span.set_attribute(ERROR_TYPE_ATTR, error_type(report.error))
        span.set_status(trace.StatusCode.ERROR, type(report.error).__name__)
    span.end()
