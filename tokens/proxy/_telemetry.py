"""The proxy's telemetry: a span and a duration per proxied call by dialect, capture failures by type.

Only the OpenTelemetry API, through the lazy never-raising helpers the rest of ``tokens`` uses.
Attributes never carry the upstream's URL or credentials, nor request content.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Counter, Histogram, Meter

from _shared_telemetry import DURATION_BUCKETS_MS

__all__ = ["DIALECT_ATTR", "OUTCOME_ATTR", "STREAM_ATTR", "UPSTREAM_ATTR", "ProxyInstruments"]

DIALECT_ATTR = "tokens.proxy.dialect"
STREAM_ATTR = "tokens.proxy.stream"
UPSTREAM_ATTR = "tokens.proxy.upstream_api"
OUTCOME_ATTR = "tokens.proxy.outcome"


@dataclass(frozen=True)
class ProxyInstruments:
    duration_ms: Histogram
    capture_errors: Counter

    @classmethod
    def create(cls, meter: Meter) -> ProxyInstruments:
        return cls(
            duration_ms=meter.create_histogram(
                "tokens.proxy.duration_ms",
                unit="ms",
                description="Proxied model calls, from the request to the answer's last byte, by dialect and outcome.",
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_MS),
            ),
            capture_errors=meter.create_counter(
                "tokens.proxy.capture_error_total",
                unit="{call}",
                description="Proxied calls whose capture failed, by dialect and error type.",
            ),
        )
