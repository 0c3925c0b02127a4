"""Token-capture telemetry: which source gave each bundle, what failed, and what the fallback cost.

Uses the lazy, never-raising helpers shared with the sandbox middlewares (``_shared_telemetry``:
only the OpenTelemetry API; nothing is created or recorded without an SDK).
"""

from __future__ import annotations

from opentelemetry.metrics import Counter, Histogram

from _shared_telemetry import InstrumentBundle, counter, duration_ms

__all__ = ["TokenInstruments"]

SCOPE = "tokens"
SOURCE_ATTR = "tokens.source"


class TokenInstruments(InstrumentBundle):
    sources: Counter = counter("tokens.capture.source_total", "{completion}", "Bundles captured, by source.")
    errors: Counter = counter("tokens.capture.error_total", "{completion}", "Completions that failed, by error type.")
    tokenize_ms: Histogram = duration_ms(
        "tokens.tokenize_fallback.duration_ms",
        "Time of the /tokenize fallback request (a second awaited round trip per turn).",
    )
