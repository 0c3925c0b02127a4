"""Fixtures shared by the test modules: a base_dir for sandboxes, the real vLLM server for integration tests;
tests that need bubblewrap skipped (failed with REQUIRE_BWRAP=1) where it cannot run (see ``tests/bwrap.py``)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from sandbox_middleware.providers.local._mounts import mounts_under, unmount

from .bwrap import bwrap_problem, only_bwrap_unavailable, required, unavailable
from .vllm.server import require_vllm_python, running_server

# The tests' Ray clusters listen on loopback only. Ray 2.60 turns token authentication on for a new
# local cluster (``ray.init()`` without an address) and writes ~/.ray/auth_token, which then switches
# every later ``ray start`` on the machine to token mode (and a client without it fails with
# InvalidAuthToken): a file left behind that changes other runs. Set before any test imports ray,
# inherited by the heads, workers and CLI processes the tests start.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# Tests that cannot share the machine with one another, one group each: pytest-xdist (``-n 2 --dist
# loadgroup``, .ci/run) runs a group's tests in one worker, one after another, while the other workers run
# the rest. Ray: each module starts a local cluster and its workers, and one Prometheus scrapes every
# worker's /metrics; the host pools: machine-wide counts (the kernel's open-file table, pids); the docs:
# examples that serve or expect a server on fixed ports (vLLM's localhost:8000, Prometheus' 9464); vLLM:
# the real server (a CPU vLLM, gigabytes and minutes to start) is started once, in one worker.
XDIST_GROUPS = {
    "tests/tokens/test_vllm_integration.py": "vllm",
    "tests/tokens/records/test_vllm_records.py": "vllm",
    "tests/tokens/proxy/test_vllm_proxy.py": "vllm",
    "tests/sandbox/cli/test_ray.py": "ray",
    "tests/sandbox/middleware/admission/test_ray.py": "ray",
    "tests/tokens/records/test_cross_process.py": "ray",
    "tests/sandbox/providers/local/containment/test_host_pools.py": "host-pools",
    "tests/docs/test_examples.py": "docs",
    "tests/sandbox/providers/docker/test_podman.py": "podman",  # one private Podman service per run
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires_bwrap(condition=True): needs bubblewrap where nothing in this process shows it (a "
        "subprocess, the CLI) when condition is true; skipped where bwrap cannot run, failed with REQUIRE_BWRAP=1",
    )
    config.addinivalue_line("markers", "xdist_group(name): run in one pytest-xdist worker with its group")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A module moved without its entry here runs beside its group and breaks it (two Ray heads, one
    # ``ray stop --force``): a stale path fails the run instead.
    root = Path(str(config.rootpath))
    if stale := [path for path in XDIST_GROUPS if not (root / path).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py XDIST_GROUPS names missing modules {stale}: update their paths")
    for item in items:
        if (group := XDIST_GROUPS.get(item.nodeid.split("::")[0])) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """A ``requires_bwrap`` test, and a test whose own skip reason or fixture says bwrap is missing, is
    skipped with the one line of ``tests/bwrap.py`` (failed with REQUIRE_BWRAP=1)."""
    marker = item.get_closest_marker("requires_bwrap")
    if marker is not None and (marker.args[0] if marker.args else True) and (problem := bwrap_problem()):
        unavailable(problem)
    try:
        return (yield)
    except pytest.skip.Exception as exc:
        if "bwrap" in (exc.msg or "") and (problem := bwrap_problem()):  # skipif(not HAS_BWRAP, reason="bwrap ..")
            unavailable(problem)
        raise
    except BaseException as exc:
        _bwrap_unavailable(exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    except BaseException as exc:
        _bwrap_unavailable(exc)
        raise


def _bwrap_unavailable(exc: BaseException) -> None:
    """If ``exc`` is only ``BwrapUnavailableError`` and bwrap cannot run here: skip (or under
    REQUIRE_BWRAP=1 let the error fail the test, saying why). Any other error, or this one where bwrap
    does run, stays what it is."""
    if not only_bwrap_unavailable(exc) or (problem := bwrap_problem()) is None:
        return
    if required():
        exc.add_note(f"{problem} (REQUIRE_BWRAP=1: CI must run the tests that need it)")
        return
    unavailable(problem)


@pytest.fixture(scope="session")
def vllm_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM server on a tiny random model; skipped (failed in CI) where vLLM is not installed."""
    with running_server(require_vllm_python(), tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture
def sandbox_base() -> Iterator[Path]:
    """A base_dir for LocalProvider that its sandbox user can reach (pytest's tmp_path is mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="sandbox-middleware-test-"))
    base.chmod(0o711)
    yield base / "boxes"
    if (base / "boxes").is_dir() and any((base / "boxes").iterdir()):
        gc.collect()  # a provider the test dropped without aclose removes its spare (its finalizer)
    for point in mounts_under(base):  # the layers of a snapshot a test kept (a sandbox's tmpfs goes with it)
        unmount(point)
    shutil.rmtree(base, ignore_errors=True)
