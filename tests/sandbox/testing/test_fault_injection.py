"""The fault injector itself, and a cancellation at every await point of a session through the stack."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    LocalProvider,
    ReleaseAccountingMiddleware,
    Sandbox,
    SandboxError,
    SandboxHandle,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSnapshot,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
    SandboxSpec,
    SupportsSandboxList,
    SupportsSandboxSnapshot,
    recommended_middleware,
    stack,
)
from sandbox_middleware.testing import (
    FAULT_STREAM,
    OPERATIONS,
    SNAPSHOT_OPERATIONS,
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


# -- the in-memory provider's files and snapshots ----------------------------------------------------


async def _write(
    provider: FaultInjectingProvider, handle: SandboxHandle, tmp_path: Path, target: str, text: str
) -> None:
    source = tmp_path / "upload"
    source.write_text(text)
    await provider.upload_file(handle, source, target)


async def _read(provider: FaultInjectingProvider, handle: SandboxHandle, tmp_path: Path, source: str) -> str:
    target = tmp_path / "download"
    await provider.download_file(handle, source, target)
    return target.read_text()


async def test_in_memory_snapshots_fork_a_state_no_fork_shares(tmp_path: Path) -> None:
    """Files written before the snapshot are in every fork; one written in a fork is in no other and not in
    the parent; the parent keeps changing without touching the forks; a fork's spec (workdir, metadata) is its own."""
    provider = FaultInjectingProvider()
    assert isinstance(provider, SupportsSandboxSnapshot) and isinstance(provider, SupportsSandboxList)
    parent = await provider.create(SandboxSpec(workdir="/repo"))
    await _write(provider, parent, tmp_path, "src/main.py", "print(1)")
    await _write(provider, parent, tmp_path, "/etc/outside-workdir", "not in the snapshot")
    snapshot = await provider.snapshot(parent, metadata={"task": "t1"})
    assert (
        snapshot.provider == "faulty" and snapshot.size_bytes == len("print(1)") and snapshot.metadata == {"task": "t1"}
    )
    assert provider.snapshots == {snapshot.snapshot_id}
    forks = [
        await provider.create(SandboxSpec(workdir="/repo", metadata={"fork": str(n)}), from_snapshot=snapshot)
        for n in range(2)
    ]  # type: ignore[call-arg]
    await _write(provider, parent, tmp_path, "src/main.py", "print(2)")
    await _write(provider, forks[0], tmp_path, "only-here.txt", "fork 0")
    assert await _read(provider, forks[0], tmp_path, "/repo/src/main.py") == "print(1)"
    assert await _read(provider, forks[1], tmp_path, "src/main.py") == "print(1)"
    assert await _read(provider, parent, tmp_path, "src/main.py") == "print(2)"
    for other in (forks[1], parent):
        with pytest.raises(SandboxError, match="is not a file in sandbox"):
            await _read(provider, other, tmp_path, "only-here.txt")
    with pytest.raises(SandboxError, match="is not a file in sandbox"):
        await _read(provider, forks[0], tmp_path, "/etc/outside-workdir")
    [listed] = await provider.list(metadata={"fork": "1"})
    assert listed.handle.sandbox_id == forks[1].sandbox_id
    # paths: relative to the working directory or absolute; the default is the working directory
    both = await provider.snapshot(parent, paths=["src", "/etc/outside-workdir"])
    assert both.size_bytes == len("print(2)") + len("not in the snapshot")
    for handle in (*forks, parent):
        await provider.close(handle)


async def test_in_memory_snapshots_refuse_what_they_do_not_hold(tmp_path: Path) -> None:
    """Hostile descriptors and paths: a path out of the sandbox, an altered, foreign or deleted snapshot, a
    non-snapshot: typed errors, and the record untouched."""
    provider = FaultInjectingProvider()
    other = FaultInjectingProvider(name="other")
    handle = await provider.create(SandboxSpec())
    await _write(provider, handle, tmp_path, "a.txt", "a")
    for path in ("../../etc/passwd", "/..", "a/../../.."):
        with pytest.raises(SandboxPathError, match="leaves the sandbox"):
            await provider.snapshot(handle, paths=[path])
    with pytest.raises(SandboxPathError):
        await _write(provider, handle, tmp_path, "../../x", "x")  # /workspace/../.. climbs out
    with pytest.raises(SandboxSnapshotError, match="names no file"):
        await provider.snapshot(handle, paths=["missing"])
    snapshot = await provider.snapshot(handle, metadata={"sandbox_middleware.run_id": "mine"})
    altered = dataclasses.replace(snapshot, metadata={"sandbox_middleware.run_id": "theirs"})
    foreign = dataclasses.replace(snapshot, provider="other")
    for bad in (altered, foreign):
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.create(SandboxSpec(), from_snapshot=bad)  # type: ignore[call-arg]
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.delete_snapshot(bad)
    with pytest.raises(SandboxSnapshotNotFoundError):  # taken by another provider
        await other.create(SandboxSpec(), from_snapshot=snapshot)  # type: ignore[call-arg]
    with pytest.raises(SandboxSnapshotError, match="not dict"):
        await provider.create(SandboxSpec(), from_snapshot=snapshot.to_dict())  # type: ignore[call-arg]
    assert await provider.list_snapshots() == [snapshot]  # nothing of it was touched
    restored = SandboxSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict())))  # another process's copy
    fork = await provider.create(SandboxSpec(), from_snapshot=restored)  # type: ignore[call-arg]
    await provider.delete_snapshot(restored)
    assert await provider.list_snapshots() == [] and provider.snapshots == set()
    for use in (provider.delete_snapshot(snapshot), provider.create(SandboxSpec(), from_snapshot=snapshot)):  # type: ignore[call-arg]
        with pytest.raises(SandboxSnapshotNotFoundError, match="deleted"):
            await use
    assert await _read(provider, fork, tmp_path, "a.txt") == "a"  # a fork outlives its snapshot
    await provider.close(handle)
    with pytest.raises(SandboxNotFoundError):
        await provider.snapshot(handle)
    await provider.close(fork)


async def test_list_snapshots_filters_on_metadata() -> None:
    provider = FaultInjectingProvider()
    handle = await provider.create(SandboxSpec())
    first = await provider.snapshot(handle, metadata={"run": "a", "task": "1"})
    second = await provider.snapshot(handle, metadata={"run": "a", "task": "2"})
    await provider.snapshot(handle, metadata={"run": "b"})
    assert await provider.list_snapshots(metadata={"run": "a"}) == [first, second]
    assert await provider.list_snapshots(metadata={"run": "a", "task": "2"}) == [second]
    assert len(await provider.list_snapshots()) == 3
    assert await provider.list_snapshots(metadata={"run": "c"}) == []


async def test_snapshot_faults_latency_and_hang_points() -> None:
    """The snapshot calls take failure rates, latency and hang points like the six operations; an injected
    failure has no effect, and the ground truth (``snapshots``) follows what really exists."""
    assert set(SNAPSHOT_OPERATIONS) == {"snapshot", "delete_snapshot"}
    assert parse_faults("snapshot=0.5,delete_snapshot=1") == {"snapshot": 0.5, "delete_snapshot": 1.0}
    failing = FaultInjectingProvider(failure_rates={"snapshot": 1.0})
    handle = await failing.create(SandboxSpec())
    with pytest.raises(InjectedFault, match="injected snapshot failure"):
        await failing.snapshot(handle)
    assert failing.snapshots == set() and await failing.list_snapshots() == [] and failing.calls["snapshot"] == 1
    undeletable = FaultInjectingProvider(failure_rates={"delete_snapshot": 1.0})
    held = await undeletable.snapshot(await undeletable.create(SandboxSpec()))
    with pytest.raises(InjectedFault):
        await undeletable.delete_snapshot(held)
    assert undeletable.snapshots == {held.snapshot_id} and await undeletable.list_snapshots() == [held]
    slow = FaultInjectingProvider(latency={"snapshot": 0.2})
    handle = await slow.create(SandboxSpec())
    started = anyio.current_time()
    await slow.snapshot(handle)
    assert anyio.current_time() - started >= 0.2
    hung = FaultInjectingProvider(hang_at={"snapshot:after"})
    handle = await hung.create(SandboxSpec())
    with anyio.move_on_after(0.05) as scope:
        await hung.snapshot(handle)
    assert scope.cancelled_caught  # taken, then the response never came: it exists, nobody holds it
    assert len(hung.snapshots) == 1 and len(await hung.list_snapshots()) == 1
    with pytest.raises(ValueError, match="unknown operation"):
        FaultInjectingProvider(failure_rates={"snapshots": 0.1})


async def test_snapshot_faults_in_front_of_a_provider_without_snapshots(sandbox_base: Path) -> None:
    """In front of a real provider without the capability the injector has none either."""
    local = LocalProvider(isolation="none", base_dir=sandbox_base)
    faulty = FaultInjectingProvider(local, failure_rates={"snapshot": 0.5})
    assert isinstance(faulty, SupportsSandboxSnapshot) == isinstance(local, SupportsSandboxSnapshot)
    await local.aclose()
