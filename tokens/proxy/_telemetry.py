"""The proxy's telemetry: a span and a duration per proxied call by dialect, capture failures by type.

Only the OpenTelemetry API, through the lazy never-raising helpers the rest of ``tokens`` uses.
Attributes never carry the upstream's URL or credentials, nor request content.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
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
    guarded_span,
    safely,
)

from ._dialects import Dialect
from ._errors import CaptureFailedError, ProxyError, upstream_error

__all__ = ["DIALECT_ATTR", "OUTCOME_ATTR", "STREAM_ATTR", "UPSTREAM_ATTR", "ProxyInstruments", "ProxyTelemetry"]

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


class ProxyTelemetry:
    """What the proxy tells of its calls: a span and a duration each, capture failures counted."""

    def __init__(self, meter_provider: MeterProvider | None, tracer_provider: TracerProvider | None) -> None:
        self.instruments = Instruments(ProxyInstruments.create, meter_provider, SCOPE)
        self.tracing = Tracing(tracer_provider, SCOPE)

    def upstream_error(self, exc: BaseException, dialect: Dialect | None = None) -> ProxyError:
        """The client's view of an upstream failure (``upstream_error``); a capture failure is counted."""
        error = upstream_error(exc)
        if error is not exc and isinstance(error, CaptureFailedError):
            self.count_capture_error(dialect, exc)
        return error

    def count_capture_error(self, dialect: Dialect | None, exc: BaseException) -> None:
        instruments = self.instruments.get()
        if instruments is not None:
            attributes = {
                DIALECT_ATTR: "unknown" if dialect is None else dialect.name,
                ERROR_TYPE_ATTR: error_type(exc),
            }
            safely("tokens.proxy.capture_error_total", instruments.capture_errors.add, 1, attributes)

    def span(self, attributes: dict[str, Any]) -> AbstractContextManager[Span | None]:
        """A whole answer's span, ended when the answer is made."""
        tracer = self.tracing.get()
        if tracer is None:
            return nullcontext()
        return guarded_span(tracer, f"tokens.proxy {attributes[DIALECT_ATTR]}", attributes)

    def start_span(self, dialect: Dialect, attributes: dict[str, Any]) -> Span | None:
        """A stream's span, ended by ``finished`` (or ``end_span``) when the stream is."""
        tracer = self.tracing.get()
        if tracer is None:
            return None
        try:
            return tracer.start_span(f"tokens.proxy {dialect.name}", attributes=attributes)
        except Exception:  # a broken span processor: no span, the call goes on
            return None

    def end_span(self, span: Span | None, error: ProxyError | None) -> None:
        if span is not None:
            safely("tokens.proxy span", _end_span, span, error)

    def finished(
        self, dialect: Dialect, stream: bool, started: float, error: ProxyError | None, span: Span | None = None
    ) -> None:
        outcome = "ok" if error is None else type(error).__name__
        instruments = self.instruments.get()
        if instruments is not None:
            elapsed = (time.perf_counter() - started) * 1000.0
            attributes = {DIALECT_ATTR: dialect.name, STREAM_ATTR: stream, OUTCOME_ATTR: outcome}
            safely("tokens.proxy.duration_ms", instruments.duration_ms.record, elapsed, attributes)
        if span is not None and stream:
            safely("tokens.proxy span", _end_span, span, error)
        elif span is not None and error is not None:
            safely("tokens.proxy span", span.set_attribute, OUTCOME_ATTR, outcome)


def _end_span(span: Span, error: ProxyError | None) -> None:
    if error is not None:
        span.set_attribute(ERROR_TYPE_ATTR, error_type(error))
        span.set_status(trace.StatusCode.ERROR, type(error).__name__)
    span.end()
