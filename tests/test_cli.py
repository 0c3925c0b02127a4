"""The main job end to end, as a subprocess: `sandbox-middleware run` and `check`."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .vllm.server import free_port

CLI = [sys.executable, "-m", "sandbox_middleware"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def row(output: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}\s+(.*)$", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return match.group(1)


def test_default_run_leaks_nothing() -> None:
    """With no config, a run on the local provider exits 0, leaks nothing, and peaks at most at concurrency."""
    done = run("run", "--sessions", "24", "--concurrency", "4", "--commands", "2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert row(out, "sessions ok / failed") == "24 / 0"
    assert row(out, "sandboxes started") == "24"
    peak, final = row(out, "gym.sandbox.active peak / final").split(" / ")
    assert 1 <= int(peak) <= 4 and final == "0"
    assert row(out, "sandboxes still held") == "0"
    assert "(24 samples)" in row(out, "startup ms p50 / p95 / max")
    assert "(48 samples)" in row(out, "exec ms p50 / p95 / max")
    assert "1. tracing" in done.stderr and "4. retry" in done.stderr


def test_console_script_is_installed() -> None:
    """The console script runs the same main job."""
    script = shutil.which("sandbox-middleware") or str(Path(sys.executable).parent / "sandbox-middleware")
    done = subprocess.run([script, "run", "--sessions", "2", "--commands", "1"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_run_with_faults_still_holds_nothing() -> None:
    """Under injected create, close and exec faults, retries climb and nothing is left held."""
    done = run("run", "--sessions", "60", "--concurrency", "8", "--faults", "create=0.2,close=0.2,exec=0.05",
               "--seed", "11")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert row(out, "sandboxes still held") == "0"
    assert row(out, "gym.sandbox.active peak / final").endswith("/ 0")
    assert float(row(out, "retries create / other").split(" / ")[0]) > 0  # create faults were retried away
    assert re.search(r"^  close +sandbox_middleware\.testing\.InjectedFault +\d+$", out, re.MULTILINE)
    assert "with seed 11" in done.stderr


def test_leak_exits_non_zero() -> None:
    """When closes never succeed, the run names the held sandboxes and exits non-zero."""
    done = run("run", "--sessions", "3", "--concurrency", "3", "--faults", "close=1.0", "--seed", "1")
    assert done.returncode == 1
    held = row(done.stdout, "sandboxes still held")
    assert held.startswith("3: local-")


def test_prometheus_exporter_serves_while_running() -> None:
    """With --export prometheus, /metrics serves the active counter and the duration histograms."""
    port = free_port()
    process = subprocess.Popen(
        [*CLI, "run", "--sessions", "20", "--concurrency", "4", "--export", "prometheus",
         "--prometheus-port", str(port), "--linger", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        body = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.TransportError:
                body = ""
            if "gym_sandbox_exec_duration_ms" in body and "gym_sandbox_startup_duration_ms" in body:
                break
            time.sleep(0.2)
        assert re.search(r"^gym_sandbox_active\S*\{.*nemo_gym_sandbox_provider=\"local\".*\} ", body, re.MULTILINE), (
            body
        )
        assert re.search(r"^gym_sandbox_startup_duration_ms\S*_bucket\{.*le=\"1800000\"", body, re.MULTILINE), body
        assert re.search(r"^gym_sandbox_exec_duration_ms\S*_count", body, re.MULTILINE), body
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter.otlp") is not None, reason="otlp is installed")
def test_missing_exporter_names_the_extra() -> None:
    """Asking for an exporter that is not installed says which extra to install."""
    done = run("run", "--sessions", "1", "--export", "otlp")
    assert done.returncode == 2
    assert "pip install 'llm-sandbox-middleware[otlp]'" in done.stderr


def test_check_prints_the_stack_and_rejects_bad_configs(tmp_path: Path) -> None:
    """check prints the resolved stack outermost first; a bad config exits 2 naming the problem."""
    good = tmp_path / "good.yaml"
    good.write_text(
        "provider:\n  local: {isolation: none}\n"
        "middleware:\n  - metrics\n  - retry: {attempts: 5, on: [ConnectionError]}\n"
    )
    done = run("check", str(good))
    assert done.returncode == 0
    assert done.stdout.splitlines()[2:] == [
        "  1. metrics -> MetricsMiddleware()  [built-in (llm-sandbox-middleware)]",
        "  2. retry -> RetryMiddleware(attempts=5, on=(ConnectionError,))  [built-in (llm-sandbox-middleware)]",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("provider: local\nmiddleware:\n  - retry: {attempts: 5, timeout: soon}\n")
    done = run("check", str(bad))
    assert done.returncode == 2
    assert "middleware[0] (retry): option 'timeout' must be float or null, not 'soon'" in done.stderr
    done = run("run", str(bad))
    assert done.returncode == 2 and "sessions ok" not in done.stdout


def test_console_export_prints_the_metric_data() -> None:
    """--export console prints the metric data (the active counter and both histograms) on stdout."""
    done = run("run", "--sessions", "2", "--commands", "1", "--export", "console")
    assert done.returncode == 0, done.stderr
    names = set(re.findall(r'"name": "(gym\.sandbox\.[a-z_]+)"', done.stdout))
    assert {"gym.sandbox.active", "gym.sandbox.startup_duration_ms", "gym.sandbox.exec_duration_ms"} <= names
