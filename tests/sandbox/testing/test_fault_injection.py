"""The fault injector itself, and a cancellation at every await point of a session through the stack."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    LocalProvider,
    ReleaseAccountingMiddleware,
    Sandbox,
    SandboxHandle,
    SandboxSpec,
    recommended_middleware,
    stack,
)
from sandbox_middleware.testing import (
    FAULT_STREAM,
    OPERATIONS,
    FaultInjectingProvider,
    InjectedFault,
    parse_faults,
)
from sandbox_middleware.testing.fixtures import TelemetryCapture

pytestmark = pytest.mark.anyio

POINTS = [f"{operation}:{phase}" for operation in OPERATIONS if operation != "status" for phase in ("before", "after")]


@pytest.mark.parametrize("point", POINTS)
async def test_cancellation_at_every_await_point(point: str, telemetry: TelemetryCapture, tmp_path: Path) -> None:
    """Cancelled at any await point of a session, the counter, the ledger and the ground truth still agree."""
    inner = FaultInjectingProvider(hang_at={point})
    provider = stack(
        inner,
        recommended_middleware(meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider),
    )
    accounting = provider.inner.inner  # type: ignore[attr-defined]
    source = tmp_path / "in.txt"
    source.write_text("x")
    sandbox = Sandbox(provider, SandboxSpec(files={"in.txt": str(source)}), close_timeout_s=0.2, create_timeout_s=0.2)
    if point.startswith("create"):
        # The create is shielded from cancellation and bounded in time: a hung create times out.
        with anyio.move_on_after(0.05), pytest.raises(TimeoutError):
            await sandbox.start()
        assert not sandbox.started
    elif point.startswith("close"):
        # Closing is shielded from cancellation and bounded in time: a hung close times out.
        with pytest.raises(TimeoutError):
            async with sandbox:
                await sandbox.exec("true")
        [entry] = accounting.held()
        assert entry.release_failed and telemetry.value("gym.sandbox.active") == 1
        inner.hang_at = frozenset()
        await sandbox.stop()  # the retried stop reconciles, whatever the first close did
    else:
        with anyio.move_on_after(0.1) as scope:
            async with sandbox:
                await sandbox.exec("true")
                await sandbox.download("in.txt", tmp_path / "out")
        assert scope.cancelled_caught
    held = {entry.sandbox_id for entry in accounting.held()}
    assert telemetry.value("gym.sandbox.active") == len(held) == 0
    assert held == inner.alive - inner.orphaned
    if point == "create:after":
        assert len(inner.orphaned) == 1  # created, then the provider hung: the handle never came back


async def test_cancelled_slow_create_leaves_nothing_behind() -> None:
    """A session cancelled while its create is in flight: the shielded create finishes, then is closed."""
    inner = FaultInjectingProvider(latency={"create": 0.2})
    accounting = ReleaseAccountingMiddleware(inner)
    sandbox = Sandbox(accounting)
    with anyio.move_on_after(0.05) as scope:
        async with sandbox:
            pytest.fail("the body must not run")
    assert scope.cancelled_caught and not sandbox.started and accounting.held() == []
    assert inner.alive == set() and inner.calls["create"] == inner.calls["close"] == 1


async def test_unshielded_create_can_orphan_a_sandbox() -> None:
    """With shield_create=False a cancellation after the provider made the sandbox loses its handle."""
    inner = FaultInjectingProvider(hang_at={"create:after"})
    sandbox = Sandbox(ReleaseAccountingMiddleware(inner), shield_create=False)
    with anyio.move_on_after(0.05):
        await sandbox.start()
    assert not sandbox.started and inner.orphaned == inner.alive and len(inner.alive) == 1


async def test_lost_response_and_close_failures() -> None:
    """A lost create response leaves a sandbox only the ground truth knows; a close fails N times, then works."""
    lost = FaultInjectingProvider(lost_create_rate=1.0)
    with pytest.raises(InjectedFault, match="lost response"):
        await lost.create(SandboxSpec())
    assert len(lost.alive) == 1 and lost.alive == lost.orphaned
    flaky = FaultInjectingProvider(close_failures=2)
    handle = await flaky.create(SandboxSpec())
    for _ in range(2):
        with pytest.raises(InjectedFault):
            await flaky.close(handle)
    await flaky.close(handle)
    assert not flaky.alive and [type(e).__name__ for e in flaky.injected] == ["InjectedFault"] * 2


async def test_wrapping_a_real_provider(tmp_path: Path, sandbox_base: Path) -> None:
    """In front of a real provider the effects are real and the faults still injected."""
    local = LocalProvider(base_dir=sandbox_base)
    faulty = FaultInjectingProvider(local, failure_rates={"exec": 1.0})
    assert faulty.name == "local"
    handle = await faulty.create(SandboxSpec())
    assert Path(handle.raw["root"]).is_dir()
    with pytest.raises(InjectedFault):
        await faulty.exec(handle, "true")
    await faulty.close(handle)
    assert not Path(handle.raw["root"]).exists()


def test_bad_options_and_fault_specs() -> None:
    """Unknown operations and rates outside [0, 1] are refused with the allowed values."""
    with pytest.raises(ValueError, match="unknown operation"):
        FaultInjectingProvider(failure_rates={"craete": 0.1})
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        FaultInjectingProvider(failure_rates={"create": 2})
    assert parse_faults("create=0.1, close=0.05") == {"create": 0.1, "close": 0.05}
    with pytest.raises(ValueError, match="name=probability"):
        parse_faults("create=lots")


async def _faults_by_session(order: list[int], seed: int) -> dict[int, list[str]]:
    """Sessions (a create, execs, a close each) run in ``order``, one call of each in turn, each in its
    FAULT_STREAM: what failed for each."""
    injector = FaultInjectingProvider(seed=seed, failure_rates={"create": 0.15, "exec": 0.15, "close": 0.15})
    failed: dict[int, list[str]] = {session: [] for session in order}
    handles: dict[int, SandboxHandle] = {}

    async def step(session: int, name: str, call: Callable[[], Awaitable[object]]) -> object | None:
        FAULT_STREAM.set(f"session {session}")
        try:
            return await call()
        except InjectedFault:
            failed[session].append(name)
            return None

    for session in order:
        while session not in handles:
            handle = await step(session, "create", partial(injector.create, SandboxSpec()))
            if isinstance(handle, SandboxHandle):
                handles[session] = handle
    for turn in range(4):
        for session in order:
            await step(session, f"exec {turn}", partial(injector.exec, handles[session], "true"))
    for session in order:
        await step(session, "close", partial(injector.close, handles[session]))
    return failed


async def test_a_seed_fails_the_same_calls_of_each_stream_whatever_the_interleaving() -> None:
    """Each FAULT_STREAM (a session of `sandbox-middleware run`) draws its own choices: the order in which
    sessions call does not move a fault from one to another."""
    forwards = await _faults_by_session(list(range(12)), seed=7)
    backwards = await _faults_by_session(list(reversed(range(12))), seed=7)
    assert forwards == backwards
    assert any(forwards.values()) and not all(forwards.values())  # some faults, not everywhere
    assert await _faults_by_session(list(range(12)), seed=8) != forwards
