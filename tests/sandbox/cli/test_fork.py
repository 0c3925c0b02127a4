"""`sandbox-middleware run --fork N`: each session prepares its state once (its first command, in its
own sandbox) and runs the rest of its commands in N forks of it, all closed at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox_middleware import (
    LocalProvider,
    Middleware,
    ProviderMiddleware,
    ReleaseAccountingMiddleware,
    SandboxHandle,
    SandboxSpec,
    stack,
)
from sandbox_middleware.cli._process import ProcessResult, combine
from sandbox_middleware.cli._workload import RunState, workload
from tests import ROOT
from tests.sandbox.providers.docker._support import BUSYBOX, containers, require_docker

from .test_cli import default_stack, forks_made, row, run


@default_stack
def test_each_session_runs_the_rest_of_its_commands_in_n_forks() -> None:
    """6 sessions of 3 commands, 4 forks each: 6 prepared sandboxes and 24 forks started, each timed as a
    start; the first command ran once per session, the other two in every fork; nothing is held at the end."""
    done = run("run", "--sessions", "6", "--concurrency", "3", "--commands", "3", "--fork", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "3 commands each (the first prepares, the rest run in 4 forks)" in out.splitlines()[0]
    assert row(out, "sessions ok / failed") == "6 / 0"
    assert row(out, "sandboxes started") == "30"
    assert forks_made(out) == 24
    assert "(30 samples)" in row(out, "startup ms p50 / p95 / max")
    assert "(54 samples)" in row(out, "exec ms p50 / p95 / max")  # 6 first commands, 24 forks x 2
    peak, final = row(out, "gym.sandbox.active peak / final").split(" / ")
    assert 5 <= int(peak) <= 3 * 5 and final == "0"  # a parent and its 4 forks at least, at most 3 such at once
    assert row(out, "sandboxes still held") == "0"
    assert row(out, "orphans found / reaped") == "0 / 0"


@default_stack
def test_a_fork_run_under_faults_leaks_nothing_and_counts_what_it_made() -> None:
    """Injected create, close and exec faults: creates from a snapshot are retried like any create, every
    fork is closed, and the counts agree (forks are N per session that got to fork, started counts them)."""
    done = run(
        "run", "--sessions", "30", "--concurrency", "6", "--commands", "2", "--fork", "3",
        "--faults", "create=0.1,close=0.05,exec=0.03", "--seed", "6",
    )  # fmt: skip
    out = done.stdout
    assert row(out, "sandboxes still held") == "0", out + done.stderr
    assert row(out, "gym.sandbox.active peak / final").endswith("/ 0")
    ok, failed = (int(n) for n in row(out, "sessions ok / failed").split(" / "))
    assert ok + failed == 30 and failed > 0  # the exec faults landed
    assert done.returncode == 3, out + done.stderr
    forks, started = forks_made(out), int(row(out, "sandboxes started"))
    assert forks % 3 == 0 and forks // 3 <= started - forks <= 30
    assert int(row(out, "retries create / close / other").split(" / ")[0]) > 0
    assert "Traceback" not in done.stderr


@default_stack
def test_a_snapshot_that_cannot_be_deleted_is_a_leak() -> None:
    """Every snapshot delete fails: each session's fork fails (its forks closed), and the snapshots left are
    reported held and make the exit code 1, as a leaked sandbox does; reap of the run deletes them."""
    done = run("run", "--sessions", "2", "--concurrency", "2", "--commands", "2", "--fork", "2",
               "--faults", "delete_snapshot=1.0", "--seed", "1", "--run-id", "cli-fork-leak")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert row(done.stdout, "sessions ok / failed") == "0 / 2"
    assert row(done.stdout, "sandboxes still held") == "0"
    assert row(done.stdout, "snapshots taken / still held").startswith("2 / 2 (leaked: ")
    assert forks_made(done.stdout) == 0
    reaped = run("reap", "--run", "cli-fork-leak")  # the default config's provider, as the run's
    assert reaped.returncode == 0 and "2 snapshot(s) deleted" in reaped.stderr, reaped.stdout + reaped.stderr


def test_a_fork_run_over_docker_closes_every_fork() -> None:
    """The same over the Docker daemon: each fork a container made from the snapshot's image, all removed."""
    require_docker()
    done = run(
        "run", "--provider", "docker", "--image", BUSYBOX, "--sessions", "2", "--concurrency", "2",
        "--commands", "2", "--fork", "2", "--run-id", "cli-docker-fork", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert row(done.stdout, "sessions ok / failed") == "2 / 0"
    assert row(done.stdout, "sandboxes started") == "6" and forks_made(done.stdout) == 4
    assert row(done.stdout, "sandboxes still held") == "0"
    assert containers("sandbox_middleware.docker.meta.sandbox_middleware.run_id=cli-docker-fork") == []


def test_a_bad_fork_count_is_one_line() -> None:
    for arguments, message in [
        (["--fork", "0"], "argument --fork: must be from 1 to 256, not 0"),
        (["--fork", "257"], "argument --fork: must be from 1 to 256, not 257"),
        (["--fork", "two"], "argument --fork: must be a whole number, not 'two'"),
        (["--fork", "2", "--commands", "0"], "argument --fork: needs --commands 1 or more"),
    ]:
        done = run("run", *arguments, "--sessions", "1")
        assert done.returncode == 2, (arguments, done.stderr)
        assert len(done.stderr.splitlines()) == 1 and message in done.stderr, (arguments, done.stderr)
        assert done.stdout == ""


WITHOUT_SNAPSHOTS = """
import sys
from sandbox_middleware import register_provider
from sandbox_middleware.cli._main import main
from tests.providers import PlainProvider
register_provider("plain", PlainProvider)  # it knows the protocol only: no capability
sys.exit(main())
"""


def test_a_provider_without_snapshots_is_refused_before_any_session(tmp_path: Path) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text("provider: plain\nmiddleware: [metrics, release_accounting]\n")

    def main(*arguments: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", WITHOUT_SNAPSHOTS, "run", str(config), "--sessions", "3", *arguments]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)

    done = main("--fork", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        "sandbox-middleware run: error: argument --fork: provider 'plain' (PlainProvider) takes no "
        "snapshots (it has no SupportsSandboxSnapshot), so its sandboxes cannot be forked; run without --fork, or "
        "on a provider that has the capability"
    )
    assert "sessions ok" not in done.stdout and "Traceback" not in done.stderr
    plain = main()  # the same stack without --fork runs: the refusal is the fork's
    assert plain.returncode == 0 and row(plain.stdout, "sessions ok / failed") == "3 / 0", plain.stderr


class SharedResult(ProviderMiddleware):
    """Every sandbox made from a snapshot finds a line of another sandbox's in its result.txt: a fork that
    shares files with another one."""

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        handle = await self.inner.create(spec, **extensions)
        if "from_snapshot" in extensions:
            await self.inner.exec(handle, "echo step 9 >> result.txt")
        return handle


@pytest.mark.anyio
@pytest.mark.parametrize("shared", [False, True], ids=["own-files", "shared-files"])
async def test_a_fork_whose_files_are_not_its_own_fails_its_session(tmp_path: Path, shared: bool) -> None:
    """The workload checks each fork's result: the prepared step, then its own steps, nothing else."""
    layers = [Middleware(ReleaseAccountingMiddleware), *([Middleware(SharedResult)] if shared else [])]
    provider = stack(LocalProvider(isolation="none", base_dir=tmp_path / "boxes"), layers)
    accounting = provider
    assert isinstance(accounting, ReleaseAccountingMiddleware)
    state = RunState(2)
    await workload(provider, state, concurrency=2, commands=2, fork=2, handle_signals=False)
    assert (state.ok, state.failed, state.forks, state.started) == ((0, 2) if shared else (2, 0)) + (4, 6)
    assert state.session_errors == ({"SandboxSnapshotError": 2} if shared else {})
    assert accounting.held() == []


def test_a_run_over_workers_sums_their_forks() -> None:
    parts = [
        ProcessResult("host", pid, RunState(2, ok=2, started=2 + forks, forks=forks), {}, None, [], [])
        for pid, forks in ((1, 8), (2, 4))
    ]
    combined = combine(parts, sessions=4)
    assert (combined.run.ok, combined.run.started, combined.run.forks) == (4, 16, 12)
