"""NeMo Gym's providers inside our stack: lifecycle, telemetry, retried create failures, extension keywords."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.sandbox.providers import SandboxCreateError as NemoCreateError  # noqa: E402
from nemo_gym.sandbox.providers.apptainer.provider import _resource_flags  # noqa: E402
from nemo_gym.sandbox.providers.docker import DockerProvider  # noqa: E402
from nemo_gym.sandbox.providers.local import LocalProvider as NemoLocalProvider  # noqa: E402

import sandbox_middleware  # noqa: E402
from sandbox_middleware import (  # noqa: E402
    SANDBOX_CREATE_ERRORS,
    ConfigError,
    Middleware,
    RetryMiddleware,
    Sandbox,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
    build_provider,
    stack,
)
from sandbox_middleware.testing.fixtures import TelemetryCapture  # noqa: E402

from ..providers import recommended_stack, round_trip  # noqa: E402

pytestmark = pytest.mark.anyio

PROVIDER = {"nemo.gym.sandbox.provider": "local"}


def recommended(inner: Any, telemetry: TelemetryCapture) -> Any:
    """The README's recommended stack, with fast retries."""
    return recommended_stack(inner, telemetry, wait_initial=0.01, wait_jitter=0.0)


class FlakyCreate(NemoLocalProvider):
    """NeMo Gym's local provider whose first create fails with NeMo Gym's own SandboxCreateError."""

    failures = 1

    async def create(self, spec: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise NemoCreateError("control plane busy (scripted)")
        return await super().create(spec)


class StdinLocal(NemoLocalProvider):
    """NeMo Gym's local provider with the ``stdin=`` keyword its Docker provider's exec has."""

    async def exec(self, handle: Any, command: str, *, stdin: bytes | None = None, **kwargs: Any) -> Any:
        if stdin is not None:
            command = f"printf %s {stdin.decode()!r} | {{ {command}; }}"
        return await super().exec(handle, command, **kwargs)


def test_our_classes_derive_from_nemo_gyms() -> None:
    """With NeMo Gym installed, our protocol module interoperates with it."""
    assert sandbox_middleware._protocol.NEMO_GYM is not None
    assert NemoCreateError in SANDBOX_CREATE_ERRORS


async def test_nemo_local_provider_through_the_recommended_stack(tmp_path: Path, telemetry: TelemetryCapture) -> None:
    """Create (our default spec), exec, upload, download, status and close through the full stack,
    with our telemetry counting each exactly once."""
    provider = recommended(NemoLocalProvider(workspace_root=str(tmp_path / "boxes")), telemetry)
    handle = await provider.create(SandboxSpec())
    await round_trip(provider, handle, tmp_path)
    await provider.close(handle)
    assert await provider.status(handle) == SandboxStatus.STOPPED
    await provider.aclose()

    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms", **_attrs()) == 1
    assert telemetry.histogram_count("gym.sandbox.exec_duration_ms", **_attrs()) == 1
    assert telemetry.value("gym.sandbox.active", **_attrs()) == 0
    assert telemetry.value("gym.sandbox.failure_total") == 0
    names = [span.name for span in telemetry.spans()]
    assert names == [
        "gym.sandbox.start",
        "gym.sandbox.upload",
        "gym.sandbox.exec",
        "gym.sandbox.download",
        "gym.sandbox.status",
        "gym.sandbox.stop",
        "gym.sandbox.status",
    ]
    assert all(
        span.attributes is not None and span.attributes["nemo.gym.sandbox.id"] == handle.sandbox_id
        for span in telemetry.spans()
    )


async def test_a_nemo_create_failure_is_retried_and_counted(tmp_path: Path, telemetry: TelemetryCapture) -> None:
    """RetryMiddleware's default retries NeMo Gym's SandboxCreateError; the retry is counted once and
    the sandbox counted as started once."""
    inner = FlakyCreate(workspace_root=str(tmp_path / "boxes"))
    provider = recommended(inner, telemetry)
    async with Sandbox(provider, SandboxSpec()) as sandbox:
        assert (await sandbox.exec("echo ok")).stdout == "ok\n"
    assert inner.failures == 0
    assert telemetry.value("gym.sandbox.create_retry_total", **_attrs()) == 1
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms") == 1
    [start] = telemetry.spans("gym.sandbox.start")
    assert [event.name for event in start.events] == ["retry"]


async def test_a_nemo_create_failure_is_caught_by_our_create_errors(tmp_path: Path) -> None:
    """Without retries left, NeMo Gym's create failure reaches the caller as itself, and
    ``except SANDBOX_CREATE_ERRORS`` catches it."""
    provider = stack(FlakyCreate(workspace_root=str(tmp_path)), [Middleware(RetryMiddleware, attempts=1)])
    with pytest.raises(NemoCreateError, match="scripted"):
        try:
            await provider.create(SandboxSpec())
        except SANDBOX_CREATE_ERRORS:
            raise
        pytest.fail("not caught")


async def test_an_extension_keyword_reaches_the_nemo_provider(tmp_path: Path, telemetry: TelemetryCapture) -> None:
    """``stdin=`` (NeMo Gym's Docker provider's exec keyword) passes every layer to the provider."""
    assert "stdin" in inspect.signature(DockerProvider.exec).parameters
    provider = recommended(StdinLocal(workspace_root=str(tmp_path)), telemetry)
    handle = await provider.create(SandboxSpec())
    result = await provider.exec(handle, "cat", stdin=b"from stdin")
    assert result.stdout == "from stdin"
    await provider.close(handle)


def test_nemo_providers_read_our_specs_resources() -> None:
    """Our default spec and a spec with resources as a mapping both give NeMo Gym's providers the
    ``SandboxResources`` they read (here: NeMo Gym's Apptainer flags)."""
    assert _resource_flags(SandboxSpec().resources) == []
    spec = SandboxSpec(resources={"cpu": 2, "memory_mib": 512})
    assert _resource_flags(spec.resources) == ["--cpus", "2.0", "--memory", "512m"]


async def test_a_config_stacks_middleware_on_a_nemo_gym_provider(tmp_path: Path) -> None:
    """``provider: {nemo_gym.local: {...}}`` comes from NeMo Gym's registry, with our layers on it."""
    provider = build_provider(
        {
            "provider": {"nemo_gym.local": {"workspace_root": str(tmp_path)}},
            "middleware": ["tracing", "metrics", "release_accounting", "retry"],
        }
    )
    assert isinstance(provider.inner.inner.inner.inner, NemoLocalProvider)  # type: ignore[attr-defined]
    handle: SandboxHandle = await provider.create(SandboxSpec())
    assert (await provider.exec(handle, "echo $((6 * 7))")).stdout == "42\n"
    await provider.close(handle)
    with pytest.raises(ConfigError, match=r"Unknown sandbox provider 'nope'\. Available providers: .*docker"):
        build_provider({"provider": {"nemo_gym.nope": {}}, "middleware": []})


def _attrs() -> dict[str, str]:
    return {key.replace(".", "__"): value for key, value in PROVIDER.items()}
