"""Chaos: thousands of sessions through the full stack with random faults and random cancellations.

Reproduce a run with ``pytest tests/sandbox/test_chaos.py --chaos-seed N`` (each run prints its seed);
scale it with ``--chaos-sessions`` and ``--chaos-concurrency``.
"""

from __future__ import annotations

import contextlib
import random
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from sandbox_middleware import (
    AdmissionMiddleware,
    Middleware,
    ProviderMiddleware,
    ReleaseAccountingMiddleware,
    RetryBudget,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    WarmPoolMiddleware,
    recommended_middleware,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture

pytestmark = pytest.mark.anyio


class CountingCalls(ProviderMiddleware):
    """Counts every operation call that enters the stack (each one must yield exactly one span)."""

    calls = 0

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        CountingCalls.calls += 1
        return await super().create(spec)

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> Any:
        CountingCalls.calls += 1
        return await super().exec(handle, command, **kwargs)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        CountingCalls.calls += 1
        await super().upload_file(handle, source_path, target_path)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        CountingCalls.calls += 1
        await super().download_file(handle, source_path, target_path)

    async def close(self, handle: SandboxHandle) -> None:
        CountingCalls.calls += 1
        await super().close(handle)


class FlakySpanProcessor(SpanProcessor):
    """Raises on a share of span ends: telemetry that breaks must never reach a session."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.raised = 0

    def on_end(self, span: ReadableSpan) -> None:
        if self.rng.random() < 0.02:
            self.raised += 1
            raise RuntimeError("exporter down")


async def test_chaos(telemetry: TelemetryCapture, pytestconfig: pytest.Config, tmp_path: Path) -> None:
    """Accounting, ground truth, errors and spans agree after a seeded storm of faults and cancellations."""
    sessions = pytestconfig.getoption("--chaos-sessions")
    concurrency = pytestconfig.getoption("--chaos-concurrency")
    seed = pytestconfig.getoption("--chaos-seed")
    seed = seed if seed is not None else random.SystemRandom().randrange(1_000_000)
    print(f"\nchaos seed {seed}: reproduce with --chaos-seed {seed} --chaos-sessions {sessions}")
    rng = random.Random(seed)
    flaky = FlakySpanProcessor(rng)
    telemetry.tracer_provider.add_span_processor(flaky)
    inner = FaultInjectingProvider(
        seed=seed,
        failure_rates={"create": 0.15, "upload": 0.03, "exec": 0.03, "download": 0.03, "close": 0.1},
        lost_create_rate=0.02,
        latency={"create": 0.001, "exec": 0.0005, "close": 0.0005},
    )
    CountingCalls.calls = 0
    provider: Any = stack(
        inner,
        [
            Middleware(CountingCalls),
            *recommended_middleware(
                meter_provider=telemetry.meter_provider,
                tracer_provider=telemetry.tracer_provider,
                retry={
                    "attempts": 4,
                    "wait_initial": 0.0005,
                    "wait_max": 0.002,
                    "wait_jitter": 0.0,
                    "budget": RetryBudget(max_tokens=40, token_ratio=0.2),
                },
            ),
        ],
    )
    accounting: ReleaseAccountingMiddleware = provider.inner.inner.inner
    source = tmp_path / "in.txt"
    source.write_text("x")
    sandboxes: list[Sandbox] = []
    errors: list[BaseException] = []
    outcomes = {"ok": 0, "failed": 0, "cancelled": 0}
    limiter = anyio.CapacityLimiter(concurrency)
    deadlines = [rng.uniform(0.0, 0.004) if rng.random() < 0.2 else None for _ in range(sessions)]

    async def session(number: int) -> None:
        async with limiter:
            sandbox = Sandbox(provider, SandboxSpec(), local_files={"in.txt": source}, close_timeout_s=10)
            sandboxes.append(sandbox)
            deadline = deadlines[number]
            scope: AbstractContextManager[Any] = anyio.move_on_after(deadline) if deadline else nullcontext()
            try:
                with scope as cancel:
                    async with sandbox:
                        for step in range(3):
                            await sandbox.exec(f"step {step}")
                        await sandbox.download("in.txt", tmp_path / f"out-{number}")
                    outcomes["ok"] += 1
                if cancel is not None and cancel.cancelled_caught:
                    outcomes["cancelled"] += 1
            except Exception as exc:
                outcomes["failed"] += 1
                errors.append(exc)

    started = time.monotonic()
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for number in range(sessions):
                tg.start_soon(session, number)
    elapsed = time.monotonic() - started

    held = {entry.sandbox_id for entry in accounting.held()}
    really = inner.alive - inner.orphaned
    print(
        f"chaos: {sessions} sessions in {elapsed:.1f}s: {outcomes}; held {len(held)}, orphaned by lost "
        f"create responses {len(inner.orphaned)}, telemetry failures injected {flaky.raised}"
    )

    # Cancelled sessions orphan nothing (the facade shields create): only lost responses do.
    lost = sum("lost response" in str(error) for error in inner.injected)
    assert len(inner.orphaned) == lost
    # Accounting tells the truth: the counter, the ledger and the provider's ground truth agree.
    assert telemetry.value("gym.sandbox.active") == len(held) == len(really)
    assert held == really
    # Every failed session raised a fault that was injected, never anything else (telemetry included).
    injected = {id(error) for error in inner.injected}
    unrelated = [error for error in errors if id(error) not in injected]
    assert not unrelated, unrelated[:3]
    assert flaky.raised > 0 and outcomes["failed"] > 0 and outcomes["cancelled"] > 0
    assert all(isinstance(error, Exception) for error in errors)
    # One span per operation call, cancelled and failed ones included.
    assert len(telemetry.spans()) == CountingCalls.calls
    # A cleanup pass releases everything the client holds.
    for _ in range(20):
        pending = [sandbox for sandbox in sandboxes if sandbox.started]
        if not pending:
            break
        async with anyio.create_task_group() as tg:
            for sandbox in pending:
                tg.start_soon(_stop_quietly, sandbox)
    assert telemetry.value("gym.sandbox.active") == 0 == len(accounting.held())
    assert inner.alive == inner.orphaned
    assert telemetry.value("gym.sandbox.create_retry_total") > 0


async def _stop_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.stop()
    except Exception as exc:
        assert not isinstance(exc, SandboxCreateError)


# -- admission and the warm pool: cancellation at every await point --------------------------------


async def assert_truth(telemetry: TelemetryCapture, inner: FaultInjectingProvider, provider: Any) -> None:
    """Counter == ledger == provider truth, and the admission layer's slots match what it holds."""
    accounting = _layer(provider, ReleaseAccountingMiddleware)
    admission = _layer(provider, AdmissionMiddleware)
    held = {entry.sandbox_id for entry in accounting.held()}
    assert telemetry.value("gym.sandbox.active") == len(held) == len(inner.alive - inner.orphaned)
    assert held == inner.alive - inner.orphaned
    pool = _layer(provider, (WarmPoolMiddleware, AdmissionMiddleware))
    refilling = pool._creating if isinstance(pool, WarmPoolMiddleware) else 0  # refills in flight take slots
    if admission.max_held is not None:
        assert admission.held_slots() == len(held)
        assert len(held) <= await admission._backend.call("taken", "held") <= len(held) + refilling
    assert await admission._backend.call("taken", "creating") <= refilling


def _layer(provider: Any, cls: type) -> Any:
    while not isinstance(provider, cls):
        provider = provider.inner
    return provider


def _gated_stack(telemetry: TelemetryCapture, inner: FaultInjectingProvider, pool: bool, **admission: Any) -> Any:
    layers = [
        Middleware(ReleaseAccountingMiddleware, meter_provider=telemetry.meter_provider),
        Middleware(AdmissionMiddleware, meter_provider=telemetry.meter_provider, **admission),
    ]
    if pool:
        pool = Middleware(WarmPoolMiddleware, size=2, create_timeout_s=2, meter_provider=telemetry.meter_provider)
        layers.insert(0, pool)
    provider = stack(inner, layers)
    _layer(provider, AdmissionMiddleware)._random = LongestJitter()
    return provider


class LongestJitter(random.Random):
    """Every jitter its longest: a create with jitter surely waits there when it is cancelled."""

    def uniform(self, a: float, b: float) -> float:
        return b


async def _occupy(provider: Any, point: str, tg: Any) -> list[SandboxHandle]:
    """Put the layers in the state where the next create waits at ``point``."""
    admission = _layer(provider, AdmissionMiddleware)
    if point in ("max_held", "max_create_rate"):
        return [await provider.create(SandboxSpec())]
    if point == "max_concurrent_creates":
        tg.start_soon(provider.create, SandboxSpec())  # takes the one slot for 0.3 s
        await anyio.sleep(0.02)
    if point == "retry_after":
        await admission._call("pause", 1.0)
    return []


# (admission options, faults of the provider): where the create waits when it is cancelled
AWAIT_POINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "start_jitter": ({"start_jitter_s": 1.0}, {}),
    "max_held": ({"max_held": 1}, {}),
    "max_concurrent_creates": ({"max_concurrent_creates": 1}, {"latency": {"create": 0.3}}),
    "max_create_rate": ({"max_create_rate": 1.0}, {}),
    "retry_after": ({}, {}),
    "provider create, before": ({"max_held": 5, "max_concurrent_creates": 5}, {"hang_at": {"create:before"}}),
    "provider create, after": ({"max_held": 5, "max_concurrent_creates": 5}, {"hang_at": {"create:after"}}),
}


@pytest.mark.parametrize("pool", [False, True], ids=["admission", "pool over admission"])
@pytest.mark.parametrize("point", list(AWAIT_POINTS))
async def test_a_create_cancelled_at_each_await_point(point: str, pool: bool, telemetry: TelemetryCapture) -> None:
    """Cancelled while it waits to be admitted (or in the provider), a create takes no slot and leaks
    nothing: counter == ledger == provider truth, and the layers admit the next create."""
    options, faults = AWAIT_POINTS[point]
    inner = FaultInjectingProvider(**faults)
    provider = _gated_stack(telemetry, inner, pool, **options)
    async with anyio.create_task_group() as tg:
        held = await _occupy(provider, point, tg)
        with anyio.move_on_after(0.1) as waiting:
            await provider.create(SandboxSpec())
        assert waiting.cancelled_caught, f"the create did not wait at {point}"
    await assert_truth(telemetry, inner, provider)
    if point == "provider create, after":
        # created, its handle lost by the cancel: reap's (or the TTL's) to end; a pool's refills hang there too
        assert len(inner.orphaned) == 1 + _layer(provider, (WarmPoolMiddleware, AdmissionMiddleware)).__dict__.get(
            "_creating", 0
        )
    for handle in held + [entry.handle for entry in _layer(provider, ReleaseAccountingMiddleware).held()]:
        await provider.close(handle)
    inner.hang_at = frozenset()
    with anyio.fail_after(10):  # the layers admit the next one
        await provider.close(await provider.create(SandboxSpec()))
    await provider.aclose()
    await assert_truth(telemetry, inner, provider)
    assert inner.alive == inner.orphaned


async def test_a_pool_hit_cancelled_before_its_take_loses_nothing(telemetry: TelemetryCapture) -> None:
    inner = FaultInjectingProvider()
    provider = _gated_stack(telemetry, inner, True, max_held=10)
    await provider.close(await provider.create(SandboxSpec()))  # a miss: starts the pool
    await provider.wait_ready(timeout_s=5)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await provider.create(SandboxSpec())
    assert provider.ready() == 2
    await assert_truth(telemetry, inner, provider)
    await provider.aclose()
    assert inner.alive == set() and telemetry.value("gym.sandbox.active") == 0


async def _close_retrying(provider: Any, handle: SandboxHandle) -> None:
    for _ in range(20):
        with contextlib.suppress(Exception):
            await provider.close(handle)
            return


async def test_chaos_through_a_pool_and_admission(telemetry: TelemetryCapture, pytestconfig: pytest.Config) -> None:
    """The storm again, creates called directly (no facade shielding them) under random deadlines, through
    a warm pool and admission with every limit on: the truth holds after it, and nothing is left at the end."""
    seed = pytestconfig.getoption("--chaos-seed")
    seed = seed if seed is not None else random.SystemRandom().randrange(1_000_000)
    print(f"\nchaos seed {seed}")
    rng = random.Random(seed)
    inner = FaultInjectingProvider(
        seed=seed, failure_rates={"create": 0.1, "close": 0.05}, lost_create_rate=0.02,
        latency={"create": 0.002, "close": 0.0005},
    )  # fmt: skip
    admission = {"max_held": 24, "max_concurrent_creates": 6, "max_create_rate": 2_000, "start_jitter_s": 0.001}
    provider = stack(
        inner,
        [Middleware(WarmPoolMiddleware, size=4, meter_provider=telemetry.meter_provider),
         *recommended_middleware(meter_provider=telemetry.meter_provider, admission=admission,
                                 retry={"attempts": 3, "wait_initial": 0.0005, "wait_max": 0.001, "wait_jitter": 0,
                                        "operations": ["create", "close"], "on": SandboxError})],
    )  # fmt: skip
    deadlines = [rng.uniform(0.0, 0.01) if rng.random() < 0.3 else None for _ in range(600)]
    outcomes = {"ok": 0, "failed": 0, "cancelled": 0}
    limiter = anyio.CapacityLimiter(40)

    async def session(number: int) -> None:
        async with limiter:
            deadline = deadlines[number]
            with anyio.move_on_after(deadline) if deadline else nullcontext() as scope:
                try:
                    handle = await provider.create(SandboxSpec())
                except Exception:
                    outcomes["failed"] += 1
                    return
                try:
                    await anyio.sleep(0.001)
                finally:
                    with anyio.CancelScope(shield=True):
                        await _close_retrying(provider, handle)  # a failed close holds its admission slot
                outcomes["ok"] += 1
            if scope is not None and scope.cancelled_caught:
                outcomes["cancelled"] += 1

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for number in range(len(deadlines)):
                tg.start_soon(session, number)
    print(f"chaos through a pool and admission: {outcomes}, orphaned {len(inner.orphaned)}")
    assert outcomes["cancelled"] > 0 and inner.injected
    await assert_truth(telemetry, inner, provider)
    accounting = _layer(provider, ReleaseAccountingMiddleware)
    pool = _layer(provider, WarmPoolMiddleware)
    assert len(accounting.held()) >= pool.ready()  # what is held beyond the pool: closes that failed
    for entry in accounting.held():
        if entry.release_failed:
            await provider.close(entry.handle)
    await provider.aclose()
    await assert_truth(telemetry, inner, provider)
    assert inner.alive == inner.orphaned and telemetry.value("gym.sandbox.active") == 0
