"""Chaos: thousands of sessions through the full stack with random faults and random cancellations.

Reproduce a run with ``pytest tests/sandbox/test_chaos.py --chaos-seed N`` (each run prints its seed);
scale it with ``--chaos-sessions`` and ``--chaos-concurrency``.
"""

from __future__ import annotations

import random
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from sandbox_middleware import (
    Middleware,
    ProviderMiddleware,
    ReleaseAccountingMiddleware,
    RetryBudget,
    Sandbox,
    SandboxCreateError,
    SandboxHandle,
    SandboxSpec,
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
                        await sandbox.download("out.txt", tmp_path / f"out-{number}")
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
