"""Shared pytest setup: every ``anyio``-marked test runs on asyncio and on trio; a run leaves no sandboxes behind.

The run gets a temporary directory of its own (``TMPDIR`` for this process and every subprocess it
starts); under pytest-xdist each worker gets one of its own inside the controller's. When a worker (or a
run without xdist) ends, any sandbox directory (``local-*``), workload directory (``sandbox-middleware-*``)
or mount left in its directory fails the run, and so does (under ``REQUIRE_BWRAP=1``, where CI runs alone
on its machine) a sandbox cgroup the run made and left: checked once, by the controller, after every
worker has ended. Then the directories are removed.
"""

import gc
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.leftovers import left_behind, mounts_below, sandbox_cgroups

_run_tmp: Path | None = None
_cgroups_before: set[str] | None = None  # under REQUIRE_BWRAP=1 (CI, alone on its machine): checked at the end


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


pytest_plugins = ["sandbox_middleware.testing.fixtures"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "the chaos test (tests/sandbox/test_chaos.py)")
    group.addoption("--chaos-sessions", type=int, default=2000, help="sessions in the chaos test (default 2000)")
    group.addoption("--chaos-concurrency", type=int, default=200, help="sessions at once (default 200)")
    group.addoption("--chaos-seed", type=int, default=None, help="seed to reproduce a chaos run (printed by each run)")


def _worker(config: pytest.Config) -> str | None:
    """This process's pytest-xdist worker id, or None in the controller (or a run without xdist)."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


def pytest_configure(config: pytest.Config) -> None:
    global _run_tmp, _cgroups_before
    worker = _worker(config)
    if worker is None and os.environ.get("REQUIRE_BWRAP") == "1":
        _cgroups_before = sandbox_cgroups()  # before any worker starts
    # a worker inherits the controller's TMPDIR: its own directory is made inside the controller's
    _run_tmp = Path(tempfile.mkdtemp(prefix=f"pytest-run-{worker}-" if worker else "pytest-run-"))
    _run_tmp.chmod(0o711)  # bwrap sandboxes run as an unprivileged uid that must reach their base_dir here
    os.environ["TMPDIR"] = str(_run_tmp)
    tempfile.tempdir = str(_run_tmp)


_workers_left: list[str] = []  # in the controller: what the workers reported (their ``workeroutput``)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist (-p no:xdist) has none
def pytest_testnodedown(node: object, error: object) -> None:
    """In the controller, as a worker ends: what it left behind."""
    _workers_left.extend(getattr(node, "workeroutput", {}).get("left_behind", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _run_tmp is None:
        return
    gc.collect()  # providers nothing refers to any more remove their spares (their finalizers)
    leaked = left_behind(_run_tmp)
    for crashed in _run_tmp.glob("pytest-run-*"):  # a worker that died before its own check
        leaked += [f"{crashed.name}/{entry}" for entry in left_behind(crashed)]
    if _cgroups_before is not None:
        leaked += [f"cgroup {group}" for group in sorted(sandbox_cgroups() - _cgroups_before)]
    for mount in reversed(mounts_below(_run_tmp)):  # lazily, so the directory can go
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    shutil.rmtree(_run_tmp, ignore_errors=True)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a worker: the controller reports it (a worker has no terminal)
        workeroutput["left_behind"] = [f"{_worker(session.config)}: {entry}" for entry in leaked]
        return
    leaked = _workers_left + leaked
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test run left {len(leaked)} sandbox or workload directories or mounts in its temp dir: {leaked}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
