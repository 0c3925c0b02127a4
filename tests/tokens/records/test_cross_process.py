"""Across processes and machines' worth of clients: two processes and two Ray workers capture the
turns of the same rollouts through one PostgreSQL store, each turn continuing a turn another
worker wrote (found by the lineage resolver, no parent id given); a third process freezes each
rollout and gets every turn, each parent resolved, delta prompts rebuilt into one trajectory.
Run it under ``flock /work/wt/ray.lock`` on a shared machine (it starts a local Ray cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

import anyio
import pytest

from tests import ROOT
from tests.needs import unavailable
from tests.tokens.records.rollout_worker import capture_turns

ROLLOUTS = [f"rollout-{i}" for i in range(4)]
TURNS = 8
WORKERS = 4  # processes 0 and 1, Ray workers 2 and 3


def _module(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tokens.records.rollout_worker", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ray_capture(url: str, index: int) -> int:
    return anyio.run(capture_turns, url, ROLLOUTS, TURNS, index, WORKERS)


def _started() -> None:
    time.sleep(0.5)  # long enough for the other task to need a worker of its own


def _ended(processes: list[subprocess.Popen[str]]) -> list[str]:
    """Each process's exit code and the end of its stderr (killed first if still running)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    return [f"exit {process.wait()}: {process.communicate()[1][-3000:]}" for process in processes]


def _require_ray() -> Any:
    try:
        import ray
    except ImportError:
        unavailable("ray is not installed: pip install -e '.[ray]'", "REQUIRE_RAY")
    return ray


@pytest.mark.anyio(False)
def test_two_processes_and_two_ray_workers_share_rollouts_through_postgres(postgres_url: str) -> None:
    ray = _require_ray()
    names = ",".join(ROLLOUTS)
    processes: list[subprocess.Popen[str]] = []
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
            _temp_dir=temp,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        try:
            # Both Ray workers started before any turn waits on another's (120 s each): under load a
            # worker's start (its runtime env first) can take a good part of that.
            ray.get([ray.remote(_started).remote() for _ in range(2)], timeout=300)
            processes += [_module("capture", postgres_url, names, str(TURNS), str(i), str(WORKERS)) for i in (0, 1)]
            processes.append(_module("freeze", postgres_url, names, str(TURNS)))
            remote = ray.remote(_ray_capture)
            try:
                captured = ray.get([remote.remote(postgres_url, i) for i in (2, 3)], timeout=300)
            except ray.exceptions.RayError as exc:  # the processes' side too: a worker waits on the others' turns
                pytest.fail(f"a Ray worker failed: {exc}\nthe processes printed: {_ended(processes)}")
        finally:
            ray.shutdown()
        ended = [process.communicate(timeout=300) for process in processes]  # two capturers, the freezer
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        subprocess.run(["rm", "-rf", temp], check=False)
    assert [p.returncode for p in processes] == [0, 0, 0], [err[-2000:] for _, err in ended]
    *outputs, (report_out, _) = ended
    assert captured == [len(ROLLOUTS) * 2] * 2 and [int(out) for out, _ in outputs] == [len(ROLLOUTS) * 2] * 2
    report = json.loads(report_out)
    for rollout in ROLLOUTS:
        frozen = report[rollout]
        assert frozen["turns"] == sorted(f"t{t}" for t in range(TURNS)) and not frozen["incomplete"]
        assert frozen["resolutions"] == ["resolved"]  # no parent unresolved
        assert frozen["parents"] == {f"t{t}": (f"t{t - 1}" if t else None) for t in range(TURNS)}
        assert frozen["deltas"] == TURNS - 1 and frozen["segments"] == 1 and frozen["segment_turns"] == TURNS
        assert frozen["versions"] == [f"worker-{i}" for i in range(WORKERS)]
