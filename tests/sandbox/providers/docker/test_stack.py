"""The recommended stack over DockerProvider on the real daemon: every operation, telemetry equal to ground truth."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_middleware import (
    CAPABILITIES,
    DockerProvider,
    Middleware,
    OwnershipMiddleware,
    SandboxStatus,
    recommended_middleware,
    stack,
)
from sandbox_middleware.middleware import _ownership
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import PlainProvider

from ._support import PYTHON, TAG, containers, on_daemon, one_spare, require_bridge, spec, tagged

pytestmark = pytest.mark.anyio

ATTRS = {"nemo__gym__sandbox__provider": "docker"}


async def test_every_operation_through_the_recommended_stack(
    make: Callable[..., DockerProvider], telemetry: TelemetryCapture, tmp_path: Path
) -> None:
    require_bridge()  # it publishes a port
    run_id = f"stack-run-{uuid.uuid4().hex[:8]}"  # its own: the other backend's run may be listed beside it (xdist)
    bare = make(network="bridge", connect_key=b"s" * 32)
    layers = [
        *recommended_middleware(meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider),
        Middleware(OwnershipMiddleware, run_id=run_id),
    ]
    provider = stack(bare, layers)
    assert [p for p in CAPABILITIES if isinstance(provider, p)] == [p for p in CAPABILITIES if isinstance(bare, p)]

    handle = await provider.create(spec(PYTHON, ports=[8000], entrypoint=["python3", "-m", "http.server", "8000"]))
    (tmp_path / "in.txt").write_text("payload")
    await provider.upload_file(handle, tmp_path / "in.txt", "in.txt")
    result = await provider.exec(handle, "tr a-z A-Z < in.txt > out.txt && cat out.txt")
    assert (result.return_code, result.stdout) == (0, "PAYLOAD")
    await provider.download_file(handle, "out.txt", tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "PAYLOAD"
    assert await provider.status(handle) == SandboxStatus.RUNNING
    assert (await provider.endpoint(handle, 8000)).endpoint.startswith("http://127.0.0.1:")  # type: ignore[attr-defined]
    await provider.pause(handle)  # type: ignore[attr-defined]
    assert await provider.status(handle) == SandboxStatus.PAUSED
    await provider.resume(handle)  # type: ignore[attr-defined]
    descriptor = await provider.serialize_handle(handle)  # type: ignore[attr-defined]
    again = await provider.connect(descriptor)  # type: ignore[attr-defined]
    assert again.sandbox_id == handle.sandbox_id
    [listed] = await bare.list(metadata={"sandbox_middleware.run_id": run_id})
    assert listed.handle.sandbox_id == handle.sandbox_id
    await provider.close(handle)
    assert handle.sandbox_id not in containers()
    await provider.aclose()

    # ground truth: one sandbox started and released, one exec, nothing failed or retried
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms", **ATTRS) == 1
    assert telemetry.histogram_count("gym.sandbox.exec_duration_ms", **ATTRS) == 1
    assert telemetry.value("gym.sandbox.active", **ATTRS) == 0
    assert telemetry.value("gym.sandbox.failure_total") == 0
    assert telemetry.value("gym.sandbox.create_retry_total") == 0
    names = [span.name for span in telemetry.spans()]
    assert names[:5] == [
        "gym.sandbox.start",
        "gym.sandbox.upload",
        "gym.sandbox.exec",
        "gym.sandbox.download",
        "gym.sandbox.status",
    ]
    assert names.count("gym.sandbox.stop") == 1


async def test_ownership_says_when_nothing_can_reap(
    make: Callable[..., DockerProvider], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a provider that cannot list, OwnershipMiddleware warns once instead of promising a reaper;
    over DockerProvider (labels) it does not."""
    monkeypatch.setattr(_ownership, "_WARNED", set())

    class Unlistable(PlainProvider):
        name = "unlistable"

    with caplog.at_level(logging.WARNING, logger="sandbox_middleware"):
        assert stack(make(), [Middleware(OwnershipMiddleware)]).reapable  # type: ignore[attr-defined]
        assert caplog.records == []
        for _ in range(2):
            layer = stack(Unlistable(), [*recommended_middleware(), Middleware(OwnershipMiddleware)])
            assert not layer.inner.inner.inner.inner.reapable  # type: ignore[attr-defined]
    [warning] = caplog.records
    assert "'unlistable'" in warning.getMessage() and "can never find" in warning.getMessage()


async def test_telemetry_counts_a_taken_spare_as_one_create_and_an_untaken_one_as_none(
    make: Callable[..., DockerProvider], telemetry: TelemetryCapture
) -> None:
    tag = uuid.uuid4().hex[:8]
    layers = [
        *recommended_middleware(meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider),
        Middleware(OwnershipMiddleware, run_id=f"spares-{tag}"),
    ]
    bare = make()
    provider = stack(bare, layers)
    first = await provider.create(tagged(tag))  # the ownership layer's stamp and TTL are part of the shape
    spare = await one_spare(tag, kept_by=bare)
    assert telemetry.value("gym.sandbox.active", nemo__gym__sandbox__provider="docker") == 1
    second = await provider.create(tagged(tag))
    assert second.sandbox_id == spare["Id"]
    assert telemetry.value("gym.sandbox.active", nemo__gym__sandbox__provider="docker") == 2
    for handle in (first, second):
        await provider.close(handle)
    await one_spare(tag)
    assert telemetry.value("gym.sandbox.active", nemo__gym__sandbox__provider="docker") == 0
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms", nemo__gym__sandbox__provider="docker") == 2
    assert telemetry.value("gym.sandbox.failure_total") == 0
    assert [listed.handle.sandbox_id for listed in await bare.list(metadata={TAG: tag})] == []
    await provider.aclose()
    assert on_daemon(tag) == []
