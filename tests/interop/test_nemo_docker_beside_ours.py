"""NeMo Gym 0.7.0's own CLI-based ``docker`` provider and our ``DockerProvider``, each under our recommended
stack, against the same daemon and image: the same workload passes through both, and what each
leaves for reaping is what its labels allow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.sandbox.providers.docker import DockerProvider as NemoDockerProvider  # noqa: E402

from sandbox_middleware import (  # noqa: E402
    CAPABILITIES,
    DockerProvider,
    Middleware,
    OwnershipMiddleware,
    SandboxSpec,
    SandboxStatus,
    recommended_middleware,
    stack,
)
from sandbox_middleware.testing.fixtures import TelemetryCapture  # noqa: E402

from ..providers import round_trip  # noqa: E402
from ..sandbox.providers.docker._support import (  # noqa: E402
    BUSYBOX,
    SESSION,
    SESSION_KEY,
    containers,
    engine,
    require_docker,
)

pytestmark = pytest.mark.anyio
NEMO_LABEL = "nemo-gym.sandbox=1"


@pytest.fixture(params=["ours", "nemo_gym"])
async def inner(request: pytest.FixtureRequest) -> Any:
    require_docker()
    before = set(containers(NEMO_LABEL))  # other runs' NeMo Gym containers are never touched
    provider = DockerProvider() if request.param == "ours" else NemoDockerProvider()
    yield provider
    await provider.aclose()
    with engine() as client:  # NeMo Gym's containers carry only its fixed label: remove the ones made here
        for container in set(containers(NEMO_LABEL)) - before:
            client.delete(f"/containers/{container}", params={"force": "1", "v": "1"})


async def _workload(provider: Any, tmp_path: Path) -> None:
    spec = SandboxSpec(image=BUSYBOX, env={"TASK": "t1"}, metadata={SESSION_KEY: SESSION}, ttl_s=600)
    handle = await provider.create(spec)
    await round_trip(provider, handle, tmp_path, "/tmp/")
    assert (await provider.exec(handle, "echo $TASK")).stdout == "t1\n"
    timed_out = await provider.exec(handle, "sleep 30", timeout_s=1)
    assert timed_out.error_type == "timeout"
    await provider.close(handle)
    assert await provider.status(handle) == SandboxStatus.STOPPED


async def test_the_same_workload_through_both(inner: Any, tmp_path: Path, telemetry: TelemetryCapture) -> None:
    layers = [
        *recommended_middleware(meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider),
        Middleware(OwnershipMiddleware, run_id="interop-run"),
    ]
    provider = stack(inner, layers)
    assert [p for p in CAPABILITIES if isinstance(provider, p)] == [p for p in CAPABILITIES if isinstance(inner, p)]
    await _workload(provider, tmp_path)
    attrs = {"nemo__gym__sandbox__provider": "docker"}
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms", **attrs) == 1
    assert telemetry.histogram_count("gym.sandbox.exec_duration_ms", **attrs) == 3
    assert telemetry.value("gym.sandbox.active", **attrs) == 0
    assert telemetry.value("gym.sandbox.failure_total") == 0


async def test_only_ours_carries_the_ownership_stamp_to_the_daemon(inner: Any) -> None:
    """NeMo Gym's provider writes only its fixed label: the stamp never reaches the daemon, so nothing
    can reap by run; ours lists the sandbox by the stamp (and says so as `reapable`)."""
    ownership = OwnershipMiddleware(inner, run_id="stamp-run")
    handle = await ownership.create(SandboxSpec(image=BUSYBOX, metadata={SESSION_KEY: SESSION}))
    try:
        listed = await DockerProvider().list(metadata={"sandbox_middleware.run_id": "stamp-run"})
        found = [listing.handle.sandbox_id for listing in listed]
        if isinstance(inner, DockerProvider):
            assert ownership.reapable and found == [handle.sandbox_id]
        else:
            assert not ownership.reapable and found == []
    finally:
        await ownership.close(handle)
