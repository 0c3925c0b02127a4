"""Fixtures shared by the test modules: a base_dir for sandboxes, the real vLLM server for integration tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .vllm.server import running_server, vllm_python


@pytest.fixture(scope="session")
def vllm_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM server on a tiny random model; skipped (failed in CI) where vLLM is not installed."""
    python = vllm_python()
    if python is None:
        message = "vLLM is not installed for the integration tests; run: bash scripts/install-vllm.sh"
        if os.environ.get("REQUIRE_VLLM") == "1":
            pytest.fail(message + " (REQUIRE_VLLM=1: CI must run them)")
        pytest.skip(message)
    with running_server(python, tmp_path_factory.mktemp("vllm")) as url:
        yield url


@pytest.fixture
def sandbox_base() -> Iterator[Path]:
    """A base_dir for LocalProvider that its sandbox user can reach (pytest's tmp_path is mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="sandbox-middleware-test-"))
    base.chmod(0o711)
    yield base / "boxes"
    shutil.rmtree(base, ignore_errors=True)
