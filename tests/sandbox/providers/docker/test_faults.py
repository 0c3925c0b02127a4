"""Faults on the real daemon: a dockerd SIGKILLed mid-run, a worker SIGKILLed mid-run, lost create responses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from sandbox_middleware import (
    DockerProvider,
    DockerUnavailableError,
    MetricsMiddleware,
    Middleware,
    OwnershipMiddleware,
    ReleaseAccountingMiddleware,
    RetryMiddleware,
    SandboxCreateError,
    reap,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import crashed_worker

from ._daemon import private_daemon
from ._support import RUNTIME, SESSION, SESSION_KEY, engine_kind, require_docker, spec

pytestmark = pytest.mark.anyio
RUN = "sandbox_middleware.run_id"
CLI = [sys.executable, "-m", "sandbox_middleware"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # one backend is enough for processes killed on purpose


async def test_dockerd_killed_mid_run_then_reap_takes_exactly_that_run(
    tmp_path: Path, telemetry: TelemetryCapture
) -> None:
    """Creates in flight when dockerd dies are retried or fail typed; the metrics count each outcome
    once; after the restart, `reap CONFIG --run ID --force` removes that run's containers and no other's."""
    require_docker()
    if RUNTIME is not None or engine_kind() == "podman":
        pytest.skip("it runs a private dockerd of its own, under runc: once, in the pass of the default daemon")
    bridge = Path("/sys/class/net/docker0").exists()
    with private_daemon() as daemon:
        bare = DockerProvider(socket=daemon.socket)
        other = stack(bare, [Middleware(OwnershipMiddleware, run_id="other-run")])
        kept = await other.create(spec())
        layers = [
            Middleware(MetricsMiddleware, meter_provider=telemetry.meter_provider),
            Middleware(ReleaseAccountingMiddleware, meter_provider=telemetry.meter_provider),
            Middleware(
                RetryMiddleware,
                attempts=40,
                timeout=60,
                wait_initial=0.05,
                wait_max=0.2,
                wait_jitter=0.0,
                operations=["create"],
                on=(SandboxCreateError,),
                meter_provider=telemetry.meter_provider,
            ),
            Middleware(OwnershipMiddleware, run_id="killed-run"),
        ]
        provider = stack(bare, layers)
        made: list[str] = []
        failed: list[BaseException] = []

        async def session() -> None:
            try:
                made.append((await provider.create(spec())).sandbox_id)
            except (SandboxCreateError, DockerUnavailableError) as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tasks:
            for _ in range(12):
                tasks.start_soon(session)
            await anyio.sleep(0.3)
            daemon.kill()
            await anyio.to_thread.run_sync(daemon.start)  # the creates in flight retry meanwhile
        assert len(made) + len(failed) == 12
        assert all(isinstance(exc, SandboxCreateError) for exc in failed), failed
        assert made, "no create rode out the restart"
        assert telemetry.value("gym.sandbox.create_retry_total") >= 1
        assert telemetry.histogram_count("gym.sandbox.startup_duration_ms") == len(made)
        assert telemetry.value("gym.sandbox.failure_total", operation="create") == len(failed)
        assert telemetry.value("gym.sandbox.active") == len(made)

        config = tmp_path / "docker.yaml"
        config.write_text(json.dumps({"provider": {"docker": {"socket": daemon.socket}}, "middleware": []}))
        run_ids = {listing.metadata.get(RUN) for listing in await bare.list(metadata={SESSION_KEY: SESSION})}
        assert run_ids <= {"killed-run", "other-run"}
        argv = [*CLI, "reap", str(config), "--run", "killed-run", "--force"]
        done = await anyio.to_thread.run_sync(lambda: subprocess.run(argv, capture_output=True, text=True, timeout=120))
        assert done.returncode == 0, done.stdout + done.stderr
        left = await bare.list(metadata={SESSION_KEY: SESSION})
        assert [listing.handle.sandbox_id for listing in left] == [kept.sandbox_id]
        assert set(made) <= set(done.stdout.split())  # reported by id
        await bare.close(kept)
        await bare.aclose()
    assert Path("/sys/class/net/docker0").exists() == bridge  # the machine's daemon keeps its bridge


_WORKER = """
import sys, anyio
from sandbox_middleware import DockerProvider, Middleware, OwnershipMiddleware, SandboxSpec, stack
async def main():
    provider = stack(DockerProvider(runtime=sys.argv[5] or None), [Middleware(OwnershipMiddleware, run_id=sys.argv[1])])
    for _ in range(3):
        handle = await provider.create(SandboxSpec(image=sys.argv[2], metadata={sys.argv[3]: sys.argv[4]}))
        print(handle.sandbox_id, flush=True)
    await anyio.sleep(3600)
anyio.run(main)
"""


async def test_a_killed_workers_containers_are_found_and_reaped(make: Callable[..., DockerProvider]) -> None:
    from ._support import BUSYBOX, RUNTIME

    provider = make()
    argv = [sys.executable, "-c", _WORKER, "worker-run", BUSYBOX, SESSION_KEY, SESSION, RUNTIME or ""]
    crashed = await crashed_worker(argv)
    live = stack(provider, [Middleware(OwnershipMiddleware, run_id="worker-run")])
    mine = await live.create(spec())
    reaped = await reap(provider, run_id="worker-run")
    assert {entry.sandbox_id for entry in reaped} == crashed
    assert all(entry.closed and "gone" in entry.reason for entry in reaped)
    left = {listing.handle.sandbox_id for listing in await provider.list(metadata={RUN: "worker-run"})}
    assert left == {mine.sandbox_id}
    await provider.close(mine)


async def test_lost_create_responses_are_found_as_orphans(make: Callable[..., DockerProvider]) -> None:
    injector = FaultInjectingProvider(make(), seed=7, lost_create_rate=0.5)
    provider = stack(injector, [Middleware(ReleaseAccountingMiddleware), Middleware(OwnershipMiddleware)])
    accounting = provider
    ownership = provider.inner  # type: ignore[attr-defined]
    for _ in range(8):
        try:
            await provider.create(spec())
        except Exception:  # the injected loss raises; the container exists
            continue
    assert injector.orphaned
    orphans = await accounting.orphans(ownership.stamp)  # type: ignore[attr-defined]
    assert {listing.handle.sandbox_id for listing in orphans} == injector.orphaned
    for listing in orphans:
        await provider.close(listing.handle)
    await accounting.release_held()  # type: ignore[attr-defined]


async def test_a_ttl_container_is_watched_before_it_exists(
    make: Callable[..., DockerProvider], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed between the container's create and the end of ``create`` (seeding) leaves no
    unwatched TTL container: the watchdog of the socket is started before the container is made."""
    from sandbox_middleware.providers.docker import _ttl

    from ._support import SOCKET, spec

    socket = tmp_path / "docker.sock"  # another path to the same daemon: a watchdog of its own
    socket.symlink_to(SOCKET)
    provider = make(socket=str(socket))
    lock = _ttl.lock_path(str(socket))
    original = provider._create_container
    held = []

    async def create_container(*args: object, **kwargs: object) -> str:
        with anyio.move_on_after(10):
            while not _ttl._running(lock):
                await anyio.sleep(0.05)
        held.append(_ttl._running(lock))
        return await original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(provider, "_create_container", create_container)
    handle = await provider.create(spec(ttl_s=600))
    assert held == [True]
    await provider.close(handle)
    await provider.aclose()  # and its spare, which the watchdog watches too
    # It leaves nothing behind: the watchdog ends once idle. It watches the whole daemon, so other tests'
    # TTL containers and spares keep it on: it must end within IDLE_S (and a poll, a 30 s request) of the last.
    last_watched = time.monotonic()
    with (
        httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://docker") as client,
        anyio.move_on_after(_ttl.IDLE_S + 120),
    ):
        while _ttl._running(lock):
            if _ttl._expired(client, time.time())[1]:
                last_watched = time.monotonic()
            idle = time.monotonic() - last_watched
            assert idle < _ttl.IDLE_S + 40, f"the watchdog did not end {idle:.0f} s after the last container it watched"
            await anyio.sleep(0.2)
