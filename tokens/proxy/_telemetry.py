"""The proxy's telemetry: a span and a duration per proxied call by dialect, capture failures by type.

Only the OpenTelemetry API, through the lazy never-raising helpers the rest of ``tokens`` uses.
Attributes never carry the upstream's URL or credentials, nor request content.
"""

from __future__ import annotations

from opentelemetry.metrics import Counter, Histogram

from _shared_telemetry import InstrumentBundle, counter, duration_ms

__all__ = ["DIALECT_ATTR", "OUTCOME_ATTR", "STREAM_ATTR", "UPSTREAM_ATTR", "ProxyInstruments"]

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
