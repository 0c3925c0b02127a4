"""`sandbox-middleware run --provider docker --image IMAGE` and `reap --provider docker` on the real daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ._support import BUSYBOX, containers, require_docker

CLI = [sys.executable, "-m", "sandbox_middleware"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_run_over_docker_then_reap_by_run() -> None:
    require_docker()
    done = _run(
        "run",
        "--provider",
        "docker",
        "--image",
        BUSYBOX,
        "--sessions",
        "6",
        "--concurrency",
        "3",
        "--run-id",
        "cli-docker-run",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "provider docker" in done.stdout and "sessions ok / failed             6 / 0" in done.stdout
    assert containers("sandbox_middleware.docker.meta.sandbox_middleware.run_id=cli-docker-run") == []
    reaped = _run("reap", "--provider", "docker", "--run", "cli-docker-run", "--dry-run")
    assert reaped.returncode == 0 and "0 sandbox(es) found" in reaped.stderr, reaped.stderr


def test_provider_with_a_config_is_a_usage_error_and_neither_is_the_default(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("provider: {local: {isolation: none}}\n")
    for command in ("run", "reap"):
        done = _run(command, str(config), "--provider", "docker")
        assert done.returncode == 2 and "--provider" in done.stderr, done.stderr
    done = _run("reap", "--run", "cli-docker-nothing", "--dry-run")  # the default config's provider, as run's
    assert done.returncode == 0 and "0 sandbox(es) found" in done.stderr, done.stderr


def test_a_missing_image_is_one_usage_error_at_start() -> None:
    """An image the daemon does not have fails the run once, before any session (exit 2), not every
    session (it was exit 3 and a SandboxImageNotFoundError per session)."""
    require_docker()
    done = _run("run", "--provider", "docker", "--image", "sandbox-middleware/absent:none", "--sessions", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "sandbox-middleware run: error: argument --image: DockerProvider: image "
        "'sandbox-middleware/absent:none' is not on the daemon"
    ), last
    assert "sessions ok" not in done.stdout and "Traceback" not in done.stderr
