"""Metrics, tracing and release accounting against the real OpenTelemetry SDK."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import StatusCode

import _shared_telemetry
from sandbox_middleware import (
    MetricsMiddleware,
    Middleware,
    ReleaseAccountingMiddleware,
    Sandbox,
    SandboxCreateError,
    SandboxProvider,
    SandboxSpec,
    TracingMiddleware,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider, InjectedCreateError, InjectedFault
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import ConnectProvider

pytestmark = pytest.mark.anyio

ACTIVE = "gym.sandbox.active"
STARTUP = "gym.sandbox.startup_duration_ms"
EXEC = "gym.sandbox.exec_duration_ms"
FAILURES = "gym.sandbox.failure_total"


def recommended(inner: SandboxProvider, telemetry: TelemetryCapture) -> Any:
    return stack(
        inner,
        [
            Middleware(TracingMiddleware, tracer_provider=telemetry.tracer_provider),
            Middleware(MetricsMiddleware, meter_provider=telemetry.meter_provider),
            Middleware(ReleaseAccountingMiddleware, meter_provider=telemetry.meter_provider),
        ],
    )


def accounting_of(provider: Any) -> ReleaseAccountingMiddleware:
    while not isinstance(provider, ReleaseAccountingMiddleware):
        provider = provider.inner
    return provider


async def test_start_stop_moves_active_one_to_zero(telemetry: TelemetryCapture) -> None:
    """Start makes active 1, stop makes it 0, a second stop leaves it 0."""
    inner = FaultInjectingProvider()
    provider = recommended(inner, telemetry)
    handle = await provider.create(SandboxSpec())
    assert telemetry.value(ACTIVE, nemo__gym__sandbox__provider="faulty") == 1
    assert [h.sandbox_id for h in accounting_of(provider).held()] == [handle.sandbox_id]
    await provider.exec(handle, "true")
    await provider.close(handle)
    assert telemetry.value(ACTIVE) == 0
    await provider.close(handle)
    assert telemetry.value(ACTIVE) == 0
    assert accounting_of(provider).held() == []
    assert telemetry.histogram_count(STARTUP, nemo__gym__sandbox__provider="faulty") == 1
    assert telemetry.histogram_count(EXEC, nemo__gym__sandbox__provider="faulty") == 1


async def test_failed_create_counts_nothing(telemetry: TelemetryCapture) -> None:
    """A failed create adds nothing to active, no startup sample, and one failure by type."""
    provider = recommended(FaultInjectingProvider(failure_rates={"create": 1.0}), telemetry)
    with pytest.raises(InjectedCreateError):
        await provider.create(SandboxSpec())
    assert telemetry.value(ACTIVE) == 0
    assert telemetry.histogram_count(STARTUP) == 0
    assert (
        telemetry.value(FAILURES, operation="create", error__type="sandbox_middleware.testing.InjectedCreateError") == 1
    )
    [span] = telemetry.spans("gym.sandbox.start")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["error.type"] == "sandbox_middleware.testing.InjectedCreateError"
    assert "nemo.gym.sandbox.id" not in span.attributes
    assert [event.name for event in span.events] == ["exception"]


async def test_exec_that_raises_records_no_sample(telemetry: TelemetryCapture) -> None:
    """An exec that raised is a failure, not a latency; any exit code is a sample."""
    inner = FaultInjectingProvider(failure_rates={"exec": 1.0})
    provider = recommended(inner, telemetry)
    handle = await provider.create(SandboxSpec())
    with pytest.raises(InjectedFault):
        await provider.exec(handle, "true")
    assert telemetry.histogram_count(EXEC) == 0
    assert telemetry.value(FAILURES, operation="exec") == 1
    [span] = telemetry.spans("gym.sandbox.exec")
    assert span.status.status_code is StatusCode.ERROR


async def test_failed_initial_upload_releases_the_count(telemetry: TelemetryCapture) -> None:
    """Through the facade, a failed upload of spec.files closes the sandbox and active returns to 0."""
    inner = FaultInjectingProvider(failure_rates={"upload": 1.0})
    provider = recommended(inner, telemetry)
    with pytest.raises(InjectedFault):
        async with Sandbox(provider, SandboxSpec(files={"a.txt": "/nonexistent"})):
            pytest.fail("body must not run")
    assert telemetry.value(ACTIVE) == 0
    assert inner.alive == set()
    assert telemetry.value(FAILURES, operation="upload") == 1


async def test_failed_close_stays_counted_until_retried(telemetry: TelemetryCapture) -> None:
    """A close that raised keeps the sandbox counted and marked; the retried stop releases it once."""
    inner = FaultInjectingProvider(close_failures=2)
    provider = recommended(inner, telemetry)
    sandbox = Sandbox(provider)
    await sandbox.start()
    for _ in range(2):
        with pytest.raises(InjectedFault):
            await sandbox.stop()
        assert telemetry.value(ACTIVE) == 1
    [held] = accounting_of(provider).held()
    assert held.release_failed and held.sandbox_id == sandbox.handle.sandbox_id and held.provider == "faulty"
    await sandbox.stop()
    assert telemetry.value(ACTIVE) == 0
    assert accounting_of(provider).held() == []
    stops = telemetry.spans("gym.sandbox.stop")
    assert [span.status.status_code for span in stops] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    assert telemetry.value(FAILURES, operation="close") == 2


async def test_connected_sandbox_is_not_subtracted(telemetry: TelemetryCapture) -> None:
    """A handle from connect() is neither counted nor subtracted when closed."""
    provider = recommended(ConnectProvider(), telemetry)
    mine = await provider.create(SandboxSpec())
    theirs = await provider.connect({"sandbox_id": "elsewhere-1"})
    assert telemetry.value(ACTIVE) == 1
    await provider.close(theirs)
    assert telemetry.value(ACTIVE) == 1
    await provider.close(mine)
    assert telemetry.value(ACTIVE) == 0


class CountingNoOpMeterProvider(NoOpMeterProvider):
    def __init__(self) -> None:
        self.meters = 0

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        self.meters += 1
        return super().get_meter(*args, **kwargs)


async def test_no_sdk_records_nothing_and_still_accounts() -> None:
    """Without an SDK no meter or tracer is used, and the ledger still works."""
    meter_provider = CountingNoOpMeterProvider()
    provider = stack(
        FaultInjectingProvider(),
        [
            Middleware(TracingMiddleware),  # the global API provider: no SDK in tests
            Middleware(MetricsMiddleware, meter_provider=meter_provider),
            Middleware(ReleaseAccountingMiddleware, meter_provider=meter_provider),
        ],
    )
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "true")
    assert len(accounting_of(provider).held()) == 1
    await provider.close(handle)
    assert accounting_of(provider).held() == []
    assert meter_provider.meters == 0
    assert provider._tracing.get() is None


class RaisingMeterProvider(MeterProvider):
    """A meter provider whose instruments raise on every record."""

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        class Broken:
            def add(self, *a: Any, **k: Any) -> None:
                raise RuntimeError("instrument broke")

            record = add

        class Meter:
            def __getattr__(self, name: str) -> Any:
                return lambda *a, **k: Broken()

        return Meter()


class RaisingProcessor(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("exporter broke")


async def test_broken_telemetry_never_reaches_the_caller(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raising instruments and span processors are logged once each and never raise into the caller."""
    monkeypatch.setattr(_shared_telemetry, "_reported", set())
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(RaisingProcessor())
    meter_provider = RaisingMeterProvider()
    inner = FaultInjectingProvider(failure_rates={"exec": 0.5}, seed=3)
    provider = stack(
        inner,
        [
            Middleware(TracingMiddleware, tracer_provider=tracer_provider),
            Middleware(MetricsMiddleware, meter_provider=meter_provider),
            Middleware(ReleaseAccountingMiddleware, meter_provider=meter_provider),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware.telemetry"):
        for _ in range(5):
            handle = await provider.create(SandboxSpec())
            with contextlib.suppress(InjectedFault):
                await provider.exec(handle, "true")
            await provider.close(handle)
    assert inner.alive == set()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == len(set(messages)) > 0
    assert any("gym.sandbox.active" in m for m in messages)
    assert any("gym.sandbox.startup_duration_ms" in m for m in messages)
    assert any("span gym.sandbox" in m for m in messages)


async def test_one_instrument_set_per_meter(telemetry: TelemetryCapture, caplog: pytest.LogCaptureFixture) -> None:
    """Two middleware instances on one meter provider share their instruments; the SDK sees no duplicate."""
    with caplog.at_level(logging.WARNING):
        first = MetricsMiddleware(FaultInjectingProvider(name="a"), meter_provider=telemetry.meter_provider)
        second = MetricsMiddleware(FaultInjectingProvider(name="b"), meter_provider=telemetry.meter_provider)
        await first.create(SandboxSpec())
        await second.create(SandboxSpec())
    assert first._instruments.get() is second._instruments.get()
    assert not [r for r in caplog.records if "already" in r.getMessage()]
    assert telemetry.histogram_count(STARTUP, nemo__gym__sandbox__provider="a") == 1
    assert telemetry.histogram_count(STARTUP, nemo__gym__sandbox__provider="b") == 1


async def test_histogram_bounds_reach_thirty_minutes(telemetry: TelemetryCapture) -> None:
    """Both duration histograms have explicit buckets ending at 1,800,000 ms."""
    provider = MetricsMiddleware(FaultInjectingProvider(), meter_provider=telemetry.meter_provider)
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "true")
    for name in (STARTUP, EXEC):
        [point] = telemetry.points(name)
        assert point.explicit_bounds[-1] == 1_800_000
        assert len(point.explicit_bounds) > 10


async def test_spans_carry_provider_id_and_names(telemetry: TelemetryCapture, tmp_path: Path) -> None:
    """Every operation has its span, with the provider and the sandbox id; commands are not recorded."""
    provider = TracingMiddleware(FaultInjectingProvider(), tracer_provider=telemetry.tracer_provider)
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "echo secret-token", env={"API_KEY": "hunter2"})
    (tmp_path / "a").write_text("a")
    await provider.upload_file(handle, tmp_path / "a", "a")
    await provider.download_file(handle, "a", tmp_path / "b")
    await provider.status(handle)
    await provider.close(handle)
    spans = telemetry.spans()
    assert [span.name for span in spans] == [
        "gym.sandbox.start",
        "gym.sandbox.exec",
        "gym.sandbox.upload",
        "gym.sandbox.download",
        "gym.sandbox.status",
        "gym.sandbox.stop",
    ]
    for span in spans:
        assert span.attributes is not None
        assert span.attributes["nemo.gym.sandbox.provider"] == "faulty"
        assert span.attributes["nemo.gym.sandbox.id"] == handle.sandbox_id
        assert "secret-token" not in str(span.attributes) and "hunter2" not in str(span.attributes)
    assert spans[1].attributes is not None and spans[1].attributes["nemo.gym.sandbox.return_code"] == 0


async def test_record_command_truncates(telemetry: TelemetryCapture) -> None:
    """With record_command=True the command is recorded, truncated to the configured length."""
    provider = TracingMiddleware(
        FaultInjectingProvider(), tracer_provider=telemetry.tracer_provider, record_command=True, command_max_length=8
    )
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "echo 0123456789")
    [span] = telemetry.spans("gym.sandbox.exec")
    assert span.attributes is not None and span.attributes["nemo.gym.sandbox.command"] == "echo 012"


async def test_cancellation_is_not_an_error(telemetry: TelemetryCapture) -> None:
    """A cancelled operation ends its span without error status."""
    provider = TracingMiddleware(
        FaultInjectingProvider(hang_at={"exec:before"}), tracer_provider=telemetry.tracer_provider
    )
    handle = await provider.create(SandboxSpec())
    with anyio.move_on_after(0.05):
        await provider.exec(handle, "true")
    [span] = telemetry.spans("gym.sandbox.exec")
    assert span.status.status_code is StatusCode.UNSET


async def test_aclose_warns_about_held_and_can_release(caplog: pytest.LogCaptureFixture) -> None:
    """aclose names the sandboxes still held; with release_on_aclose it closes them first."""
    inner = FaultInjectingProvider()
    leaky = ReleaseAccountingMiddleware(inner)
    handles = [await leaky.create(SandboxSpec()) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware"):
        await leaky.aclose()
    [record] = [r for r in caplog.records if "at aclose" in r.getMessage()]
    assert all(h.sandbox_id in record.getMessage() for h in handles)
    caplog.clear()

    inner = FaultInjectingProvider(close_failures=5)
    tidy = ReleaseAccountingMiddleware(inner, release_on_aclose=True)
    await tidy.create(SandboxSpec())
    inner.close_failures = 0
    stuck = await tidy.create(SandboxSpec())
    inner._close_attempts[stuck.sandbox_id] = -5  # this one keeps failing
    inner.close_failures = 0
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware"):
        await tidy.aclose()
    assert [h.sandbox_id for h in tidy.held()] == [stuck.sandbox_id]
    assert inner.alive == {stuck.sandbox_id}
    [record] = [r for r in caplog.records if "at aclose" in r.getMessage()]
    assert "could not be released" in record.getMessage() and stuck.sandbox_id in record.getMessage()


async def test_thousand_concurrent_sandboxes_with_faults(telemetry: TelemetryCapture) -> None:
    """1,000 concurrent start/stop with random create and close failures: active tracks the truth."""
    inner = FaultInjectingProvider(seed=7, failure_rates={"create": 0.2, "close": 0.3})
    provider = recommended(inner, telemetry)
    sandboxes = [Sandbox(provider) for _ in range(1000)]
    outcomes: dict[str, int] = {"ok": 0, "create_failed": 0, "close_failed": 0}

    async def session(sandbox: Sandbox) -> None:
        try:
            await sandbox.start()
        except SandboxCreateError:
            outcomes["create_failed"] += 1
            return
        await sandbox.exec("true")
        try:
            await sandbox.stop()
            outcomes["ok"] += 1
        except InjectedFault:
            outcomes["close_failed"] += 1

    async with anyio.create_task_group() as tg:
        for sandbox in sandboxes:
            tg.start_soon(session, sandbox)
    assert outcomes["create_failed"] > 100 and outcomes["close_failed"] > 100
    assert telemetry.value(ACTIVE) == len(inner.alive) == len(accounting_of(provider).held()) > 0
    assert {h.sandbox_id for h in accounting_of(provider).held()} == inner.alive
    assert all(h.release_failed for h in accounting_of(provider).held())

    while any(sandbox.started for sandbox in sandboxes):
        async with anyio.create_task_group() as tg:
            for sandbox in sandboxes:
                if sandbox.started:
                    tg.start_soon(_stop_quietly, sandbox)
    assert telemetry.value(ACTIVE) == 0 == len(inner.alive)
    assert accounting_of(provider).held() == []


async def _stop_quietly(sandbox: Sandbox) -> None:
    with contextlib.suppress(InjectedFault):
        await sandbox.stop()


# -- snapshots and forks -------------------------------------------------------------------------------

SNAPSHOT_DURATION = "gym.sandbox.snapshot.duration_ms"
SNAPSHOT_SIZE = "gym.sandbox.snapshot.size_bytes"
SNAPSHOTS_HELD = "gym.sandbox.snapshot.active"
FORKS = "gym.sandbox.snapshot.fork_total"


async def test_fork_telemetry_and_the_snapshot_ledger(telemetry: TelemetryCapture, tmp_path: Path) -> None:
    """A snapshot is timed, sized, held until deleted; forks are counted, timed as starts and held like
    any sandbox; the spans say which snapshot."""
    inner = FaultInjectingProvider()
    provider = recommended(inner, telemetry)
    accounting = accounting_of(provider)
    (tmp_path / "state").write_text("x" * 1000)
    async with Sandbox(provider, local_files={"state": tmp_path / "state"}) as parent:
        parent_id = parent.handle.sandbox_id
        snapshot = await parent.snapshot()
        assert telemetry.histogram_count(SNAPSHOT_DURATION, nemo__gym__sandbox__provider="faulty") == 1
        [size] = telemetry.points(SNAPSHOT_SIZE)
        assert (size.count, size.sum) == (1, 1000)
        assert telemetry.value(SNAPSHOTS_HELD) == 1
        [held] = accounting.held_snapshots()
        assert (held.snapshot_id, held.delete_failed) == (snapshot.snapshot_id, False)
        forks = await parent.fork(3)  # a snapshot of its own, deleted once the forks are made
        assert telemetry.value(FORKS) == 3 and telemetry.histogram_count(STARTUP) == 4
        assert telemetry.value(ACTIVE) == 4 and len(accounting.held()) == 4
        assert telemetry.value(SNAPSHOTS_HELD) == 1 and telemetry.histogram_count(SNAPSHOT_DURATION) == 2
        for fork in forks:
            await fork.stop()
        await provider.delete_snapshot(snapshot)
    assert telemetry.value(SNAPSHOTS_HELD) == 0 and accounting.held_snapshots() == [] and inner.snapshots == set()
    assert telemetry.value(ACTIVE) == 0 and inner.alive == set()
    taken = telemetry.spans("gym.sandbox.snapshot")
    assert len(taken) == 2 and taken[0].attributes is not None and taken[1].attributes is not None
    forks_from = taken[1].attributes["nemo.gym.sandbox.snapshot_id"]
    assert forks_from != snapshot.snapshot_id
    assert taken[0].attributes["nemo.gym.sandbox.snapshot_id"] == snapshot.snapshot_id
    assert taken[0].attributes["nemo.gym.sandbox.snapshot_size_bytes"] == 1000
    assert taken[0].attributes["nemo.gym.sandbox.id"] == parent_id
    fork_starts = [span.attributes for span in telemetry.spans("gym.sandbox.start") if span.attributes]
    assert [attrs.get("nemo.gym.sandbox.snapshot_id") for attrs in fork_starts].count(forks_from) == 3
    deleted = [span.attributes for span in telemetry.spans("gym.sandbox.delete_snapshot") if span.attributes]
    assert [attrs["nemo.gym.sandbox.snapshot_id"] for attrs in deleted] == [forks_from, snapshot.snapshot_id]


async def test_a_failed_delete_stays_held_and_a_leaked_snapshot_is_named_at_aclose(
    telemetry: TelemetryCapture, caplog: pytest.LogCaptureFixture
) -> None:
    inner = FaultInjectingProvider(failure_rates={"delete_snapshot": 1.0})
    provider = recommended(inner, telemetry)
    accounting = accounting_of(provider)
    handle = await provider.create(SandboxSpec())
    snapshot = await provider.snapshot(handle)
    with pytest.raises(InjectedFault):
        await provider.delete_snapshot(snapshot)
    [held] = accounting.held_snapshots()
    assert held.delete_failed and telemetry.value(SNAPSHOTS_HELD) == 1
    assert (
        telemetry.value(FAILURES, operation="delete_snapshot", error__type="sandbox_middleware.testing.InjectedFault")
        == 1
    )
    [failed] = telemetry.spans("gym.sandbox.delete_snapshot")
    assert failed.status.status_code is StatusCode.ERROR
    await provider.close(handle)
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware"):
        await provider.aclose()
    assert f"1 snapshot(s) are still held (leaked?) at aclose: {snapshot.snapshot_id}" in caplog.text
    assert "sandbox(es)" not in caplog.text


async def test_release_on_aclose_deletes_held_snapshots(caplog: pytest.LogCaptureFixture) -> None:
    inner = FaultInjectingProvider()
    accounting = ReleaseAccountingMiddleware(inner, release_on_aclose=True)
    handle = await accounting.create(SandboxSpec())
    await accounting.snapshot(handle)
    await accounting.snapshot(handle)
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware"):
        await accounting.aclose()
    assert inner.snapshots == set() and inner.alive == set() and accounting.held_snapshots() == []
    assert "still held" not in caplog.text and "could not" not in caplog.text


async def test_snapshot_telemetry_without_an_sdk_records_nothing_and_broken_never_raises(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = CountingNoOpMeterProvider()
    quiet = stack(
        FaultInjectingProvider(),
        [Middleware(TracingMiddleware), Middleware(MetricsMiddleware, meter_provider=counting)],
    )
    handle = await quiet.create(SandboxSpec())
    await quiet.delete_snapshot(await quiet.snapshot(handle))
    await quiet.create(SandboxSpec(), from_snapshot=await quiet.snapshot(handle))
    assert counting.meters == 0

    monkeypatch.setattr(_shared_telemetry, "_reported", set())
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(RaisingProcessor())
    inner = FaultInjectingProvider()
    broken = stack(
        inner,
        [
            Middleware(TracingMiddleware, tracer_provider=tracer_provider),
            Middleware(MetricsMiddleware, meter_provider=RaisingMeterProvider()),
            Middleware(ReleaseAccountingMiddleware, meter_provider=RaisingMeterProvider()),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="sandbox_middleware.telemetry"):
        handle = await broken.create(SandboxSpec())
        snapshot = await broken.snapshot(handle)
        fork = await broken.create(SandboxSpec(), from_snapshot=snapshot)
        await broken.delete_snapshot(snapshot)
        for made in (fork, handle):
            await broken.close(made)
    assert inner.alive == set() and inner.snapshots == set()
    messages = [record.getMessage() for record in caplog.records]
    for name in (SNAPSHOT_DURATION, SNAPSHOTS_HELD, "span gym.sandbox.snapshot"):
        assert any(name in message for message in messages), name
