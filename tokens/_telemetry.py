"""Token-capture telemetry: which source gave each bundle, what failed, and what the fallback cost.

Uses the lazy, never-raising helpers shared with the sandbox middlewares (``_shared_telemetry``:
only the OpenTelemetry API; nothing is created or recorded without an SDK).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.metrics import Counter, Histogram, Meter

from _shared_telemetry import DURATION_BUCKETS_MS

__all__ = ["TokenInstruments"]

SCOPE = "tokens"
SOURCE_ATTR = "tokens.source"


@dataclass(frozen=True)
class TokenInstruments:
    sources: Counter
    errors: Counter
    tokenize_ms: Histogram

    @classmethod
    def create(cls, meter: Meter) -> TokenInstruments:
        return cls(
            sources=meter.create_counter(
                "tokens.capture.source_total", unit="{completion}", description="Bundles captured, by source."
            ),
            errors=meter.create_counter(
                "tokens.capture.error_total", unit="{completion}", description="Completions that failed, by error type."
            ),
            tokenize_ms=meter.create_histogram(
                "tokens.tokenize_fallback.duration_ms",
                unit="ms",
                description="Time of the /tokenize fallback request (a second awaited round trip per turn).",
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_MS),
            ),
        )
