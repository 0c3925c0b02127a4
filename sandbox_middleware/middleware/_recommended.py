"""``recommended_middleware``: the recommended stack, in its order, written once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from .._core import Middleware, ProviderMiddleware
from ._metrics import MetricsMiddleware
from ._release_accounting import ReleaseAccountingMiddleware
from ._retry import RetryMiddleware
from ._tracing import TracingMiddleware
from ._warm_pool import WarmPoolMiddleware
from .admission._middleware import AdmissionMiddleware

__all__ = ["recommended_middleware", "recommended_middleware_config"]

# The recommended stack, outermost first: each layer's name in a config, its class, the telemetry
# provider it takes, and whether it is there only when asked for (its options given). The reasons
# for the order are recommended_middleware's docstring.
_RECOMMENDED: tuple[tuple[str, type[ProviderMiddleware], str, bool], ...] = (
    ("tracing", TracingMiddleware, "tracer_provider", False),
    ("warm_pool", WarmPoolMiddleware, "meter_provider", True),
    ("metrics", MetricsMiddleware, "meter_provider", False),
    ("release_accounting", ReleaseAccountingMiddleware, "meter_provider", False),
    ("retry", RetryMiddleware, "meter_provider", False),
    ("admission", AdmissionMiddleware, "meter_provider", True),
)


def recommended_middleware(
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    retry: Mapping[str, Any] | None = None,
    admission: Mapping[str, Any] | None = None,
    warm_pool: Mapping[str, Any] | None = None,
) -> list[Middleware[Any]]:
    """The recommended stack, outermost first, for ``stack(provider, recommended_middleware())``:
    ``TracingMiddleware``, [``WarmPoolMiddleware``], ``MetricsMiddleware``,
    ``ReleaseAccountingMiddleware``, ``RetryMiddleware``, [``AdmissionMiddleware``]; the two in
    brackets when their options are given (``warm_pool={"size": 8}``, ``admission={}``).

    - Tracing outermost: its span covers the whole call and is current while everything inside
      runs, so retries appear as events on it.
    - Metrics outside Retry: ``gym.sandbox.startup_duration_ms`` is the time a rollout really
      waited for its sandbox, retries and backoff included.
    - ReleaseAccounting outside Retry: it sees exactly one handle per successful create however
      many attempts it took, and one release per successful close; it counts what the caller holds.
    - Retry right on the provider (or on Admission): it repeats only the provider call.
    - Admission below Retry: every attempt, the retried ones too, is admitted again (a retry storm
      stays within the provider's limits) and waits out the provider's Retry-After.
    - WarmPool above Metrics, ReleaseAccounting, Retry and Admission (and an Ownership layer below
      them): a pooled sandbox is created through all of them, so it is counted held, stamped,
      retried and admitted like any other; Metrics' startup duration stays the provider's start,
      and the pool's hand-out latency is its own histogram. Tracing above it: the start span is
      what the rollout waited.

    ``meter_provider`` reaches every layer but Tracing, ``tracer_provider`` Tracing (default: the
    global ones). ``retry``, ``admission`` and ``warm_pool`` are the options of those layers. More
    layers go before or after the list:
    ``stack(provider, [*recommended_middleware(), Middleware(OwnershipMiddleware)])``.
    """
    telemetry = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
    given = {"retry": retry or {}, "admission": admission, "warm_pool": warm_pool}
    middleware: list[Middleware[Any]] = []
    for name, cls, accepts, optional in _RECOMMENDED:
        chosen = given.get(name, {})
        if chosen is None and optional:
            continue
        options: dict[str, Any] = {} if telemetry[accepts] is None else {accepts: telemetry[accepts]}
        options.update(chosen or {})
        middleware.append(Middleware(cls, **options))
    return middleware


def recommended_middleware_config(
    *,
    retry: Sequence[Mapping[str, Any]] = ({},),
    admission: Mapping[str, Any] | None = None,
    warm_pool: Mapping[str, Any] | None = None,
) -> list[str | dict[str, Any]]:
    """The recommended stack as the ``middleware:`` entries of a config, outermost first, with one
    retry layer per mapping in ``retry`` (its options as a config writes them, e.g. exception names
    for ``on``), in that order, and the admission and warm pool layers when their options are given."""
    given: dict[str, Sequence[Mapping[str, Any]]] = {"retry": retry}
    for name, options in (("admission", admission), ("warm_pool", warm_pool)):
        given[name] = () if options is None else (options,)
    entries: list[str | dict[str, Any]] = []
    for name, _, _, _ in _RECOMMENDED:
        entries.extend({name: dict(options)} if options else name for options in given.get(name, ({},)))
    return entries
