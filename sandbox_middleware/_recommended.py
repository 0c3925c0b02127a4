"""``recommended_middleware``: the recommended stack, in its order, written once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from ._core import Middleware, ProviderMiddleware
from ._metrics import MetricsMiddleware
from ._release_accounting import ReleaseAccountingMiddleware
from ._retry import RetryMiddleware
from ._tracing import TracingMiddleware

__all__ = ["recommended_middleware", "recommended_middleware_config"]

# The recommended stack, outermost first: each layer's name in a config, its class, and the
# telemetry provider it takes. The reasons for the order are recommended_middleware's docstring.
_RECOMMENDED: tuple[tuple[str, type[ProviderMiddleware], str], ...] = (
    ("tracing", TracingMiddleware, "tracer_provider"),
    ("metrics", MetricsMiddleware, "meter_provider"),
    ("release_accounting", ReleaseAccountingMiddleware, "meter_provider"),
    ("retry", RetryMiddleware, "meter_provider"),
)


def recommended_middleware(
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    retry: Mapping[str, Any] | None = None,
) -> list[Middleware[Any]]:
    """The recommended stack, outermost first, for ``stack(provider, recommended_middleware())``:
    ``TracingMiddleware``, ``MetricsMiddleware``, ``ReleaseAccountingMiddleware``, ``RetryMiddleware``.

    - Tracing outermost: its span covers the whole call and is current while everything inside
      runs, so retries appear as events on it.
    - Metrics outside Retry: ``gym.sandbox.startup_duration_ms`` is the time a rollout really
      waited for its sandbox, retries and backoff included.
    - ReleaseAccounting outside Retry: it sees exactly one handle per successful create however
      many attempts it took, and one release per successful close; it counts what the caller holds.
    - Retry innermost, right on the provider: it repeats only the provider call.

    ``meter_provider`` reaches Metrics, ReleaseAccounting and Retry, ``tracer_provider`` Tracing
    (default: the global ones). ``retry`` are ``RetryMiddleware`` options (``attempts``, ``on``,
    ``operations``, ``budget`` ...). More layers go before or after the list:
    ``stack(provider, [*recommended_middleware(), Middleware(OwnershipMiddleware)])``.
    """
    telemetry = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
    middleware: list[Middleware[Any]] = []
    for _, cls, accepts in _RECOMMENDED:
        options: dict[str, Any] = {} if telemetry[accepts] is None else {accepts: telemetry[accepts]}
        if cls is RetryMiddleware:
            options.update(retry or {})
        middleware.append(Middleware(cls, **options))
    return middleware


def recommended_middleware_config(*, retry: Sequence[Mapping[str, Any]] = ({},)) -> list[str | dict[str, Any]]:
    """The recommended stack as the ``middleware:`` entries of a config, outermost first, with one
    retry layer per mapping in ``retry`` (its options as a config writes them, e.g. exception names
    for ``on``), in that order."""
    entries: list[str | dict[str, Any]] = []
    for name, cls, _ in _RECOMMENDED:
        layers = retry if cls is RetryMiddleware else ({},)
        entries.extend({name: dict(options)} if options else name for options in layers)
    return entries
