"""RetryMiddleware on stamina: counts, logs, limits, budget and cancellation."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import stamina

from sandbox_middleware import (
    Middleware,
    ProviderMiddleware,
    RetryBudget,
    RetryMiddleware,
    SandboxCreateError,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    TracingMiddleware,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import PlainProvider
from tests.retry_probe import count_retry_contexts

pytestmark = pytest.mark.anyio

CREATE_RETRIES = "gym.sandbox.create_retry_total"


@pytest.fixture(autouse=True)
def no_sleeping() -> Iterator[None]:
    """stamina's testing mode: no backoff sleeps, the configured attempts kept (capped at 100)."""
    with stamina.set_testing(True, attempts=100, cap=True):
        yield


class Scripted(ProviderMiddleware):
    """Raises the scripted errors, one per call, then lets calls through; counts calls by operation."""

    def __init__(self, inner: SandboxProvider, *, errors: list[BaseException] | None = None) -> None:
        super().__init__(inner)
        self.errors = list(errors or [])
        self.calls: dict[str, int] = {}

    def _next(self, operation: str) -> None:
        self.calls[operation] = self.calls.get(operation, 0) + 1
        if self.errors:
            raise self.errors.pop(0)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        self._next("create")
        return await super().create(spec)

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> Any:
        self._next("exec")
        return await super().exec(handle, command, **kwargs)

    async def close(self, handle: SandboxHandle) -> None:
        self._next("close")
        await super().close(handle)


def retry_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sandbox_middleware.retry"]


@pytest.mark.parametrize("failures", [0, 1, 4])
async def test_n_failures_then_success(
    failures: int, telemetry: TelemetryCapture, caplog: pytest.LogCaptureFixture
) -> None:
    """N failures then success make N+1 calls, N retries counted by provider, N warnings logged."""
    scripted = Scripted(PlainProvider(), errors=[SandboxCreateError("busy")] * failures)
    provider = RetryMiddleware(scripted, meter_provider=telemetry.meter_provider)
    with caplog.at_level(logging.WARNING):
        handle = await provider.create(SandboxSpec())
    assert handle.sandbox_id == "plain-0"
    assert scripted.calls["create"] == failures + 1
    assert telemetry.value(CREATE_RETRIES, nemo__gym__sandbox__provider="plain") == failures
    records = retry_records(caplog)
    assert len(records) == failures == telemetry.value(CREATE_RETRIES)
    for number, record in enumerate(records, start=2):
        message = record.getMessage()
        assert f"retrying create on plain: attempt {number}" in message and "busy" in message and "waiting" in message


async def test_non_matching_error_is_not_retried(telemetry: TelemetryCapture) -> None:
    """An error outside `on` propagates after one call."""
    scripted = Scripted(PlainProvider(), errors=[ValueError("bad spec")])
    provider = RetryMiddleware(scripted, meter_provider=telemetry.meter_provider)
    with pytest.raises(ValueError, match="bad spec"):
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 1
    assert telemetry.value(CREATE_RETRIES) == 0


async def test_exec_not_retried_by_default_but_when_named(telemetry: TelemetryCapture) -> None:
    """exec is passed through once unless named in operations; then it counts in retry_total."""
    scripted = Scripted(PlainProvider())
    provider = RetryMiddleware(scripted, meter_provider=telemetry.meter_provider)
    handle = await provider.create(SandboxSpec())
    scripted.errors = [ConnectionError("reset")]
    with pytest.raises(ConnectionError):
        await provider.exec(handle, "rm -rf build")
    assert scripted.calls["exec"] == 1

    named = RetryMiddleware(scripted, operations=["exec", "close"], meter_provider=telemetry.meter_provider)
    scripted.errors = [ConnectionError("reset"), ConnectionError("reset")]
    await named.exec(handle, "true")
    await named.close(handle)
    assert scripted.calls["exec"] == 1 + 3
    assert telemetry.value("gym.sandbox.retry_total", operation="exec", nemo__gym__sandbox__provider="plain") == 2


async def test_attempts_respected(telemetry: TelemetryCapture) -> None:
    """With attempts=3 an always-failing create is called three times and the last error propagates."""
    scripted = Scripted(PlainProvider(), errors=[SandboxCreateError(f"try {i}") for i in range(10)])
    provider = RetryMiddleware(scripted, attempts=3, meter_provider=telemetry.meter_provider)
    with pytest.raises(SandboxCreateError, match="try 2"):
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 3
    assert telemetry.value(CREATE_RETRIES) == 2


async def test_total_timeout_respected() -> None:
    """The total timeout stops retrying long before the attempts run out (real, tiny waits)."""
    inner = FaultInjectingProvider(failure_rates={"create": 1.0}, latency={"create": 0.02})
    provider = RetryMiddleware(inner, attempts=1000, timeout=0.2, wait_initial=0.01, wait_max=0.01, wait_jitter=0.0)
    with stamina.set_testing(False), pytest.raises(SandboxCreateError):
        await provider.create(SandboxSpec())
    assert 2 <= inner.calls["create"] < 50


async def test_predicate_with_wait_is_honoured(caplog: pytest.LogCaptureFixture) -> None:
    """A predicate decides per error and may return the wait, e.g. from a Retry-After hint."""

    class RateLimited(Exception):
        retry_after = 0.05

    seen: list[str] = []

    def on(exc: Exception) -> bool | float | dt.timedelta:
        seen.append(type(exc).__name__)
        return exc.retry_after if isinstance(exc, RateLimited) else False

    scripted = Scripted(PlainProvider(), errors=[RateLimited(), RateLimited()])
    provider = RetryMiddleware(scripted, on=on, wait_initial=5.0, wait_jitter=0.0)
    with stamina.set_testing(False), caplog.at_level(logging.WARNING):
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 3 and seen == ["RateLimited", "RateLimited"]
    waits = [float(r.getMessage().split("after waiting ")[1].split("s;")[0]) for r in retry_records(caplog)]
    assert len(waits) == 2 and all(0.04 <= w < 1.0 for w in waits)  # the hint, not wait_initial=5


async def test_attempt_timeout_and_timeout_error_only_if_named() -> None:
    """A hung attempt times out; it is retried only when TimeoutError is covered by `on`."""
    inner = FaultInjectingProvider(hang_at={"create:before"})
    provider = RetryMiddleware(inner, attempt_timeout=0.05)
    with pytest.raises(TimeoutError):
        await provider.create(SandboxSpec())
    assert inner.calls["create"] == 1

    inner = FaultInjectingProvider(hang_at={"create:before"})
    provider = RetryMiddleware(inner, attempt_timeout=0.05, attempts=3, on=(SandboxCreateError, TimeoutError))
    with pytest.raises(TimeoutError):
        await provider.create(SandboxSpec())
    assert inner.calls["create"] == 3


async def test_cancellation_is_never_retried_nor_swallowed() -> None:
    """Cancelling a create in progress cancels it: one call, and the scope sees the cancellation."""
    inner = FaultInjectingProvider(hang_at={"create:before"})
    provider = RetryMiddleware(inner, on=Exception)
    with anyio.move_on_after(0.05) as scope:
        await provider.create(SandboxSpec())
        pytest.fail("create must not return")
    assert scope.cancelled_caught
    assert inner.calls["create"] == 1


async def test_retries_appear_as_span_events(telemetry: TelemetryCapture) -> None:
    """With tracing outside, each retry is an event on the start span."""
    scripted = Scripted(PlainProvider(), errors=[SandboxCreateError("a"), ConnectionError("b")])
    provider = stack(
        scripted,
        [Middleware(TracingMiddleware, tracer_provider=telemetry.tracer_provider), Middleware(RetryMiddleware)],
    )
    await provider.create(SandboxSpec())
    [span] = telemetry.spans("gym.sandbox.start")
    events = [e for e in span.events if e.name == "retry"]
    assert [e.attributes["attempt"] for e in events if e.attributes] == [2, 3]
    assert [e.attributes["error.type"] for e in events if e.attributes] == [
        "sandbox_middleware.SandboxCreateError",
        "ConnectionError",
    ]


async def test_budget_bounds_calls_under_sustained_failure(
    telemetry: TelemetryCapture, caplog: pytest.LogCaptureFixture
) -> None:
    """1,000 concurrent creates against a dead provider make about 1,000 calls, not 10,000."""
    inner = FaultInjectingProvider(failure_rates={"create": 1.0})
    budget = RetryBudget(max_tokens=100, token_ratio=0.1)
    provider = RetryMiddleware(inner, attempts=10, budget=budget, meter_provider=telemetry.meter_provider)

    async def one() -> None:
        with pytest.raises(SandboxCreateError):
            await provider.create(SandboxSpec())

    with caplog.at_level(logging.WARNING):
        async with anyio.create_task_group() as tg:
            for _ in range(1000):
                tg.start_soon(one)
    calls = inner.calls["create"]
    assert 1000 < calls <= 1000 * 1.1
    retries = telemetry.value(CREATE_RETRIES)
    assert retries == calls - 1000 == len(retry_records(caplog))
    assert telemetry.value("gym.sandbox.retry_throttled_total", operation="create") >= 900


async def test_budget_recovers_after_successes(telemetry: TelemetryCapture) -> None:
    """Once successes refill the bucket above half, retries resume."""
    budget = RetryBudget(max_tokens=10, token_ratio=1.0)
    scripted = Scripted(PlainProvider())
    provider = RetryMiddleware(scripted, attempts=5, budget=budget, meter_provider=telemetry.meter_provider)
    scripted.errors = [SandboxCreateError("down")] * 5
    with pytest.raises(SandboxCreateError):
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 5 and budget.tokens == 5  # 4 retries, then throttled
    scripted.errors = [SandboxCreateError("down")]
    with pytest.raises(SandboxCreateError):
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 6  # no retry while at or below half
    for _ in range(3):
        await provider.create(SandboxSpec())
    scripted.errors = [SandboxCreateError("blip")]
    await provider.create(SandboxSpec())  # one failure, retried: the budget recovered
    assert scripted.calls["create"] == 6 + 3 + 2


def test_bad_options_are_clear_errors() -> None:
    """Unknown operations, bad timeouts and bad `on` values fail at construction, naming the option."""
    with pytest.raises(ValueError, match="operations must be a list of"):
        RetryMiddleware(PlainProvider(), operations=["craete"])
    with pytest.raises(ValueError, match="operations must be a list of"):
        RetryMiddleware(PlainProvider(), operations="create")
    with pytest.raises(ValueError, match="attempt_timeout"):
        RetryMiddleware(PlainProvider(), attempt_timeout=0)
    with pytest.raises(TypeError, match="on must be"):
        RetryMiddleware(PlainProvider(), on=(ValueError, "x"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        RetryBudget(max_tokens=0)


async def test_a_call_that_succeeds_sets_up_no_retry_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries cost nothing until something fails: stamina is entered only after a first failure."""
    entered = count_retry_contexts(monkeypatch)
    budget = RetryBudget(max_tokens=10, token_ratio=1)
    scripted = Scripted(PlainProvider())
    provider = RetryMiddleware(scripted, operations=["create", "close"], budget=budget, attempt_timeout=5)
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    assert entered == [] and scripted.calls == {"create": 1, "close": 1}
    scripted.errors = [SandboxCreateError("busy")]
    await provider.create(SandboxSpec())
    assert entered == [1] and scripted.calls["create"] == 3
    assert budget.tokens == 10  # one failure spent, two successes (capped) earned back


async def test_the_first_failure_is_stamina_s_first_attempt(caplog: pytest.LogCaptureFixture) -> None:
    """The first attempt runs outside stamina, yet attempts, warnings and the error raised are as before:
    the last error propagates, not chained to the first one by the replay."""
    errors = [SandboxCreateError(f"try {i}") for i in range(3)]
    scripted = Scripted(PlainProvider(), errors=list(errors))
    provider = RetryMiddleware(scripted, attempts=3)
    with caplog.at_level(logging.WARNING), pytest.raises(SandboxCreateError, match="try 2") as info:
        await provider.create(SandboxSpec())
    assert scripted.calls["create"] == 3
    assert [r.getMessage().split(":")[1].split(" after")[0] for r in retry_records(caplog)] == [
        " attempt 2",
        " attempt 3",
    ]
    assert info.value.__context__ is not errors[0] and info.value.__context__ is not errors[1]
