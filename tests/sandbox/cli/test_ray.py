"""Beyond one process, on a real local Ray cluster and a real Prometheus, both started here on loopback.

- a Ray task receives a pickled stack and runs a sandbox lifecycle through it;
- `run --ray --workers 2 --sessions 200`: one aggregated table, and one Prometheus (file-based scrape
  discovery the CLI writes) sees every worker: held sandboxes equal the provider's ground truth at a
  quiet point and 0 at the end, and 200 startups;
- a worker SIGKILLed mid-run: `reap` closes exactly what it held, and nothing of live owners.

Skipped without ray (the 'ray' extra) or /usr/bin/prometheus; REQUIRE_RAY=1 (CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from sandbox_middleware import (
    LocalProvider,
    MetricsMiddleware,
    Middleware,
    OwnershipMiddleware,
    ReleaseAccountingMiddleware,
    SandboxHandle,
    SandboxSpec,
    SupportsSandboxList,
    TracingMiddleware,
    stack,
)
from tests.needs import unavailable
from tests.vllm.server import free_port

from .test_cli import CLI, assert_clean_run, row

PROMETHEUS = Path("/usr/bin/prometheus")
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray keeps to 127.0.0.1 instead of the host's address


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A Ray head on loopback with 2 CPUs, stopped (and its files removed) after the module."""
    ray_cli = Path(sys.executable).parent / "ray"
    os.environ.update(LOOPBACK_ENV)  # before ray is imported: it reads the variable once
    try:
        import ray  # noqa: F401
    except ImportError:
        unavailable("ray is not installed: pip install -e '.[ray]'", "REQUIRE_RAY")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    start = [
        str(ray_cli),
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-cpus",
        "2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--temp-dir",
        temp,
    ]
    try:
        subprocess.run(start, check=True, capture_output=True, timeout=120, env={**os.environ, **LOOPBACK_ENV})
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(ray_cli), "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Prometheus on loopback scraping, every second, the targets listed in the returned sd file."""
    if not os.access(PROMETHEUS, os.X_OK):
        unavailable(f"{PROMETHEUS} is not installed: apt-get install prometheus", "REQUIRE_RAY")
    home = tmp_path_factory.mktemp("prometheus")
    targets = home / "workers.json"
    targets.write_text("[]")
    (home / "prometheus.yml").write_text(f"""\
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: sandbox-middleware
    file_sd_configs: [{{files: ["{targets}"], refresh_interval: 1s}}]
""")
    port = free_port()
    process = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        yield url, targets
    finally:
        process.terminate()
        process.wait(30)


def _query(url: str, promql: str, at: float | None = None) -> float | None:
    params: dict[str, Any] = {"query": promql}
    if at is not None:
        params["time"] = at
    result = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _config(tmp_path: Path, base: Path) -> Path:
    config = tmp_path / "stack.yaml"
    config.write_text(f"""\
provider: {{local: {{isolation: none, base_dir: "{base}"}}}}
middleware: [tracing, metrics, release_accounting, {{retry: {{attempts: 3, operations: [create]}}}}, ownership]
""")
    return config


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **LOOPBACK_ENV},
    )


def _ground_truth(base: Path, **metadata: str) -> list[Any]:
    async def listed() -> list[Any]:
        provider = LocalProvider(isolation="none", base_dir=base)
        try:
            return await provider.list(metadata=metadata)
        finally:
            await provider.aclose()  # leaves what it only listed

    return anyio.run(listed)


def _wait_for(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _lifecycle(provider: Any) -> tuple[str, bool, int]:
    """Runs in a Ray worker: create, exec, close through the stack it received."""

    async def main() -> tuple[str, bool, int]:
        handle = await provider.create(SandboxSpec())
        done = await provider.exec(handle, "echo hello from $PWD")
        accounting = provider
        while not isinstance(accounting, ReleaseAccountingMiddleware):
            accounting = accounting.inner
        held_while_open = len(accounting.held())
        await provider.close(handle)
        await provider.aclose()
        return done.stdout, isinstance(provider, SupportsSandboxList), held_while_open - len(accounting.held())

    return anyio.run(main)


def test_a_ray_task_runs_a_sandbox_lifecycle_through_a_pickled_stack(ray_address: str, sandbox_base: Path) -> None:
    import ray

    provider = stack(
        LocalProvider(isolation="none", base_dir=sandbox_base),
        [Middleware(TracingMiddleware), Middleware(MetricsMiddleware), Middleware(ReleaseAccountingMiddleware),
         Middleware(OwnershipMiddleware, run_id="ray-task")],
    )  # fmt: skip
    ray.init(address=ray_address, logging_level="WARNING")
    try:
        stdout, can_list, released = ray.get(ray.remote(_lifecycle).remote(provider), timeout=120)
    finally:
        ray.shutdown()
    assert stdout.startswith("hello from ") and can_list and released == 1
    assert _ground_truth(sandbox_base) == []


def test_run_over_ray_aggregates_and_one_prometheus_sees_every_worker(
    ray_address: str, prometheus: tuple[str, Path], tmp_path: Path, sandbox_base: Path
) -> None:
    url, targets = prometheus
    config = str(_config(tmp_path, sandbox_base))
    common = ["--ray", ray_address, "--workers", "2", "--export", "prometheus", "--prometheus-sd-file", str(targets)]

    # A quiet point: 4 sessions hold their sandboxes for a while; Prometheus must agree with the provider.
    quiet = _start(
        config, *common, "--sessions", "4", "--commands", "1", "--think", "15", "--run-id", "quiet", "--linger", "4"
    )
    try:
        _wait_for(lambda: len(_ground_truth(sandbox_base, **{"sandbox_middleware.run_id": "quiet"})) == 4, "4 held")
        # Prometheus hands discovered targets to its scrapers at most every 5 s.
        _wait_for(lambda: _query(url, 'count(up{run_id="quiet"} == 1)') == 2, "both workers scraped")
        time.sleep(2.5)  # a few scrapes of the quiet state
        at = time.time()
        truth = len(_ground_truth(sandbox_base, **{"sandbox_middleware.run_id": "quiet"}))
        time.sleep(1.5)
        assert _query(url, 'sum(gym_sandbox_active{run_id="quiet"})', at) == truth == 4
        assert _query(url, 'count(up{run_id="quiet"} == 1)', at) == 2  # both workers scraped
        out, err = quiet.communicate(timeout=120)
    finally:
        quiet.kill()
    assert quiet.returncode == 0, out + err
    assert row(out, "sessions ok / failed") == "4 / 0"

    big = _start(config, *common, "--sessions", "200", "--concurrency", "8", "--run-id", "big", "--linger", "6")
    try:
        assert big.stdout is not None
        lines = []
        for line in big.stdout:  # the table is printed before the linger: the workers still serve /metrics
            lines.append(line)
            if line.startswith("worker 1 "):
                break
        time.sleep(3)  # the last scrape came after the run's end
        active = _query(url, 'sum(gym_sandbox_active{run_id="big"})')
        startups = _query(url, 'sum(gym_sandbox_startup_duration_ms_milliseconds_count{run_id="big"})')
        rest, err = big.communicate(timeout=120)
    finally:
        big.kill()
    out = "".join(lines) + rest
    assert big.returncode == 0, out + err
    assert_clean_run(out, sessions=200, concurrency=8)
    workers = [line for line in out.splitlines() if line.startswith("worker ")]
    assert len(workers) == 2 and all("sessions ok / failed 100 / 0" in line for line in workers)
    assert (active, startups) == (0, 200)
    assert _ground_truth(sandbox_base) == []
    assert json.loads(targets.read_text())[0]["labels"]["run_id"] == "big"


def test_reap_closes_exactly_what_a_killed_worker_held(ray_address: str, tmp_path: Path, sandbox_base: Path) -> None:
    config = _config(tmp_path, sandbox_base)
    crash = {"sandbox_middleware.run_id": "crash"}
    workdirs = set(Path(tempfile.gettempdir()).glob("sandbox-middleware-run-*"))
    running = _start(
        str(config),
        "--ray",
        ray_address,
        "--workers",
        "2",
        "--sessions",
        "8",
        "--concurrency",
        "8",
        "--commands",
        "1",
        "--think",
        "10",
        "--run-id",
        "crash",
    )

    async def live_run() -> tuple[LocalProvider, list[SandboxHandle]]:
        local = LocalProvider(isolation="none", base_dir=sandbox_base)
        live = stack(local, [Middleware(OwnershipMiddleware, run_id="live")])
        return local, [await live.create(SandboxSpec()) for _ in range(2)]

    local, live = anyio.run(live_run)
    try:
        _wait_for(lambda: len(_ground_truth(sandbox_base, **crash)) == 8, "8 sandboxes of the run")
        owners = {item.metadata["sandbox_middleware.owner.pid"] for item in _ground_truth(sandbox_base, **crash)}
        assert len(owners) == 2
        victim = min(owners)
        os.kill(int(victim), signal.SIGKILL)
        held_by_victim = {
            item.handle.sandbox_id
            for item in _ground_truth(sandbox_base, **crash)
            if item.metadata["sandbox_middleware.owner.pid"] == victim
        }
        assert len(held_by_victim) == 4
        time.sleep(0.5)  # the other worker is alive and still holds its 4
        reaped = subprocess.run(
            [*CLI, "reap", str(config), "--run", "crash"], capture_output=True, text=True, timeout=120
        )
        assert reaped.returncode == 0, reaped.stderr
        assert {line.split()[0] for line in reaped.stdout.splitlines()} == held_by_victim
        survivors = {item.handle.sandbox_id for item in _ground_truth(sandbox_base)}
        assert {handle.sandbox_id for handle in live} <= survivors and not held_by_victim & survivors
        out, err = running.communicate(timeout=120)
    finally:
        running.kill()

        async def close_live() -> None:
            for handle in live:
                await local.close(handle)
            await local.aclose()

        anyio.run(close_live)
    assert running.returncode == 1, out + err  # a lost worker: its run must be reaped
    assert "LOST" in out and f"sandbox-middleware reap {config} --run crash closes them" in out
    assert row(out, "sessions ok / failed") == "4 / 0"
    assert _ground_truth(sandbox_base) == []
    # The killed worker could not remove its workload directory (Ray's workers share this run's TMPDIR);
    # the live one did.
    left = set(Path(tempfile.gettempdir()).glob("sandbox-middleware-run-*")) - workdirs
    assert len(left) == 1
    shutil.rmtree(left.pop())
