"""``recommended_middleware``: the recommended stack, its order and its options; the CLI's default config."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox_middleware import (
    AdmissionMiddleware,
    MetricsMiddleware,
    OwnershipMiddleware,
    ReleaseAccountingMiddleware,
    RetryBudget,
    RetryMiddleware,
    SandboxCreateError,
    SandboxHandle,
    SandboxSpec,
    TracingMiddleware,
    WarmPoolMiddleware,
    recommended_middleware,
    resolve_config,
    stack,
)
from sandbox_middleware.cli._main import DEFAULT_CONFIG
from sandbox_middleware.middleware._recommended import recommended_middleware_config
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import PlainProvider

pytestmark = pytest.mark.anyio

ORDER = [TracingMiddleware, MetricsMiddleware, ReleaseAccountingMiddleware, RetryMiddleware]


def layers(provider: Any) -> list[Any]:
    found = []
    while hasattr(provider, "inner"):
        found.append(provider)
        provider = provider.inner
    return found


def test_the_order_is_tracing_metrics_accounting_retry() -> None:
    """Outermost first; a stack built from it has the layers in that order, the provider innermost."""
    middleware = recommended_middleware()
    assert [entry.cls for entry in middleware] == ORDER
    assert [repr(entry) for entry in middleware] == [f"Middleware({cls.__name__})" for cls in ORDER]
    inner = PlainProvider()
    built = layers(stack(inner, middleware))
    # (a layer overriding a capability method the provider lacks is a subclass hiding it, named the same)
    assert [type(layer).__qualname__ for layer in built] == [cls.__qualname__ for cls in ORDER]
    assert all(isinstance(layer, cls) for layer, cls in zip(built, ORDER, strict=True)) and built[-1].inner is inner


def test_options_reach_their_layers(telemetry: TelemetryCapture) -> None:
    """The meter provider reaches Metrics, ReleaseAccounting and Retry, the tracer provider Tracing,
    and the retry options Retry (which may name a meter provider of its own)."""
    budget = RetryBudget(max_tokens=10, token_ratio=0.5)
    tracing, metrics, accounting, retry = layers(
        stack(
            PlainProvider(),
            recommended_middleware(
                meter_provider=telemetry.meter_provider,
                tracer_provider=telemetry.tracer_provider,
                retry={"attempts": 3, "operations": ("create", "close"), "budget": budget},
            ),
        )
    )
    assert tracing._tracing._provider is telemetry.tracer_provider
    assert metrics._instruments._provider is telemetry.meter_provider
    assert accounting._instruments._provider is telemetry.meter_provider
    assert retry._instruments._provider is telemetry.meter_provider
    assert retry.attempts == 3 and retry.operations == {"create", "close"} and retry.budget is budget
    own = object()  # a meter provider of Retry's own (not built here)
    [*_, entry] = recommended_middleware(meter_provider=telemetry.meter_provider, retry={"meter_provider": own})
    assert entry.kwargs == {"meter_provider": own}


class FailsFirstCreate(PlainProvider):
    """Its first create fails as a provider that could not create the sandbox does."""

    failed = False

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        if not self.failed:
            self.failed = True
            raise SandboxCreateError("no capacity")
        return await super().create(spec)


async def test_the_order_does_what_the_docstring_says(telemetry: TelemetryCapture) -> None:
    """A create retried once: one start span carrying the retry event (Tracing outermost), one startup
    duration including the retry (Metrics outside Retry), one sandbox held (ReleaseAccounting outside
    Retry), one retry counted."""
    inner = FailsFirstCreate()
    provider = stack(
        inner,
        recommended_middleware(
            meter_provider=telemetry.meter_provider,
            tracer_provider=telemetry.tracer_provider,
            retry={"wait_initial": 0.0, "wait_jitter": 0.0},
        ),
    )
    await provider.create(SandboxSpec())
    [span] = telemetry.spans("gym.sandbox.start")
    assert [event.name for event in span.events] == ["retry"]
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms") == 1
    assert telemetry.value("gym.sandbox.active") == 1
    assert telemetry.value("gym.sandbox.create_retry_total") == 1
    assert telemetry.value("gym.sandbox.failure_total") == 0


def test_the_config_form_is_the_same_stack() -> None:
    """The config entries resolve to the same classes in the same order, one retry layer per options mapping;
    the CLI's default config is that stack with two retry layers, and ownership innermost."""
    assert recommended_middleware_config() == ["tracing", "metrics", "release_accounting", "retry"]
    resolved = resolve_config({"provider": "local", "middleware": recommended_middleware_config()})
    assert [layer.cls for layer in resolved.middleware] == [entry.cls for entry in recommended_middleware()]
    two = recommended_middleware_config(retry=[{"attempts": 2}, {"operations": ["close"]}])
    assert two[3:] == [{"retry": {"attempts": 2}}, {"retry": {"operations": ["close"]}}]
    default = resolve_config(DEFAULT_CONFIG).middleware
    assert [layer.cls for layer in default] == [*ORDER, RetryMiddleware, AdmissionMiddleware, OwnershipMiddleware]
    assert default[5].options == {}  # admission without caps: 429s wait out Retry-After, quotas fail typed
    assert [sorted(layer.options["operations"]) for layer in default[3:5]] == [["create"], ["close"]]


def test_admission_and_the_pool_go_where_the_docstring_says(telemetry: TelemetryCapture) -> None:
    """Each only when its options are given: the pool right below Tracing, admission below Retry; the options
    and the meter provider reach them; the config form is the same stack."""
    middleware = recommended_middleware(
        meter_provider=telemetry.meter_provider, warm_pool={"size": 3}, admission={"max_create_rate": 5}
    )
    order = [
        TracingMiddleware,
        WarmPoolMiddleware,
        MetricsMiddleware,
        ReleaseAccountingMiddleware,
        RetryMiddleware,
        AdmissionMiddleware,
    ]
    assert [entry.cls for entry in middleware] == order
    built = layers(stack(PlainProvider(), middleware))
    pool, admission = built[1], built[5]
    assert pool.size == 3 and admission.max_create_rate == 5
    assert pool._instruments._provider is admission._instruments._provider is telemetry.meter_provider
    assert [entry.cls for entry in recommended_middleware(admission={})] == [*ORDER, AdmissionMiddleware]
    config = recommended_middleware_config(warm_pool={"size": 3}, admission={"max_create_rate": 5})
    assert config == [
        "tracing",
        {"warm_pool": {"size": 3}},
        "metrics",
        "release_accounting",
        "retry",
        {"admission": {"max_create_rate": 5}},
    ]
    resolved = resolve_config({"provider": "local", "middleware": config})
    assert [layer.cls for layer in resolved.middleware] == order


async def test_a_retried_create_is_admitted_again(telemetry: TelemetryCapture) -> None:
    """Admission below Retry: the retried attempt waits for its own rate token (two admitted waits)."""
    provider = stack(
        FailsFirstCreate(),
        recommended_middleware(
            meter_provider=telemetry.meter_provider,
            retry={"wait_initial": 0.0, "wait_jitter": 0.0},
            admission={"max_create_rate": 20},
        ),
    )
    await provider.create(SandboxSpec())
    assert telemetry.histogram_count("gym.sandbox.admission.wait_duration_ms") == 2
    assert telemetry.value("gym.sandbox.admission.throttled_total", reason="max_create_rate") == 1
    assert telemetry.value("gym.sandbox.create_retry_total") == 1
