"""Telemetry parity: for one workload, our layers emit the instruments and spans NeMo Gym 0.7.0 emits
itself: the same names, units, kinds, descriptions, attribute keys and histogram boundaries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import context, trace
from opentelemetry.trace import StatusCode

from . import require_nemo_gym

require_nemo_gym()

import nemo_gym.sandbox.api as nemo_api  # noqa: E402
import nemo_gym.telemetry.setup as nemo_setup  # noqa: E402
from nemo_gym.sandbox.api import AsyncSandbox  # noqa: E402
from nemo_gym.telemetry import gym_metrics  # noqa: E402
from nemo_gym.telemetry.span_groups import GymSpanGroup  # noqa: E402

from sandbox_middleware import (  # noqa: E402
    LocalProvider,
    ProviderMiddleware,
    SandboxCreateError,
    SandboxHandle,
    SandboxSpec,
)
from sandbox_middleware.testing.fixtures import TelemetryCapture  # noqa: E402

from ..providers import recommended_stack  # noqa: E402

pytestmark = pytest.mark.anyio


class FailsFirstCreate(ProviderMiddleware):
    """One failed create attempt, so the retry counter has a point."""

    failed = False

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        if not self.failed:
            self.failed = True
            raise SandboxCreateError("scripted first-attempt failure")
        return await super().create(spec, **extensions)


@pytest.fixture
def nemo_telemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[TelemetryCapture]:
    """NeMo Gym's own telemetry, recording into an in-memory SDK.

    Its metrics come from its ``gym_metrics`` recorders on the meter of its telemetry handle. Its
    facade's spans go through nemo-lens, which does not import on Python 3.11 (nemo-lens 0.1.0 uses
    the 3.12 ``type`` statement), so its sandbox span group is switched on here with the few lines
    of lens's ``managed_span`` semantics: start the span with the site's attributes, make it
    current, record an exception, end it. Names and attributes are whatever NeMo Gym's code passes.
    """
    capture = TelemetryCapture()
    tracer = capture.tracer_provider.get_tracer("nemo.lens.helpers")

    @contextmanager
    def managed_span(group: str, name: str, tracer_: Any = None, **attributes: Any) -> Iterator[Any]:
        span = tracer.start_span(name, attributes={k: v for k, v in attributes.items() if v is not None})
        token = context.attach(trace.set_span_in_context(span))
        try:
            yield span
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, str(exc))
            raise
        finally:
            context.detach(token)
            span.end()

    def safe_set_span_attributes(span: Any, attributes: dict[str, Any], redact_keys: Any = None) -> None:
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)

    handle = type("Handle", (), {"meter": capture.meter_provider.get_meter("nemo.lens"), "is_exporting": True})()
    monkeypatch.setattr(nemo_setup, "get_telemetry", lambda: handle)
    monkeypatch.setattr(nemo_api, "is_span_group_enabled", lambda group: group == GymSpanGroup.SANDBOX)
    monkeypatch.setattr(nemo_api, "managed_span", managed_span)
    monkeypatch.setattr(nemo_api, "safe_set_span_attributes", safe_set_span_attributes)
    yield capture
    gym_metrics._reset_for_testing()
    capture.shutdown()


async def workload(provider: Any) -> None:
    """One sandbox through NeMo Gym's facade: start, one command, stop."""
    async with AsyncSandbox(provider, SandboxSpec(), owns_provider=False) as sandbox:
        await sandbox.start()
        assert (await sandbox.exec("echo hi")).stdout == "hi\n"
    await provider.aclose()


def instruments(capture: TelemetryCapture) -> dict[str, dict[str, Any]]:
    data = capture.metric_reader.get_metrics_data()
    found: dict[str, dict[str, Any]] = {}
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                points = list(metric.data.data_points)
                found[metric.name] = {
                    "unit": metric.unit,
                    "description": metric.description,
                    "kind": type(metric.data).__name__,
                    "monotonic": getattr(metric.data, "is_monotonic", None),
                    "attribute keys": sorted({key for point in points for key in (point.attributes or {})}),
                    "boundaries": [list(getattr(point, "explicit_bounds", ()) or ()) for point in points],
                }
    return found


def spans(capture: TelemetryCapture) -> dict[str, list[str]]:
    return {span.name: sorted(span.attributes or {}) for span in capture.spans()}


async def test_same_instruments_and_spans_as_nemo_gym(
    tmp_path: Any, nemo_telemetry: TelemetryCapture, sandbox_base: Path
) -> None:
    # NeMo Gym's side: its facade records (sandbox span group on) around a bare provider; its
    # providers that retry creates (Daytona, OpenSandbox) call this recorder once per retry.
    await workload(LocalProvider(base_dir=sandbox_base / "theirs"))
    gym_metrics.record_sandbox_create_retry(provider="local")

    # Our side: NeMo Gym's facade with its telemetry off, our recommended stack recording.
    ours = TelemetryCapture()
    try:
        with pytest.MonkeyPatch.context() as off:
            off.setattr(nemo_api, "is_span_group_enabled", lambda group: False)
            await workload(
                recommended_stack(
                    FailsFirstCreate(LocalProvider(base_dir=sandbox_base / "ours")), ours, wait_initial=0.01
                )
            )
        theirs_metrics, our_metrics = instruments(nemo_telemetry), instruments(ours)
        assert sorted(theirs_metrics) == [
            "gym.sandbox.active",
            "gym.sandbox.create_retry_total",
            "gym.sandbox.exec_duration_ms",
            "gym.sandbox.startup_duration_ms",
        ]
        assert our_metrics == theirs_metrics
        assert (
            spans(nemo_telemetry)
            == spans(ours)
            == {
                "gym.sandbox.start": ["nemo.gym.sandbox.id", "nemo.gym.sandbox.provider"],
                "gym.sandbox.exec": [
                    "nemo.gym.sandbox.id",
                    "nemo.gym.sandbox.provider",
                    "nemo.gym.sandbox.return_code",
                ],
                "gym.sandbox.stop": ["nemo.gym.sandbox.id", "nemo.gym.sandbox.provider"],
            }
        )
    finally:
        ours.shutdown()
