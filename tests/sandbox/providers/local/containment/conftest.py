"""Fixtures of the containment tests: providers for both isolations, each closed after its test."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from sandbox_middleware import LocalProvider
from tests.providers import closing_all

from ._support import ISOLATIONS


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make(sandbox_base: Path) -> AsyncIterator[Callable[..., LocalProvider]]:
    """Builds providers and closes every one of them after the test, even a failed one (before
    ``sandbox_base`` is removed, which is why it is requested here)."""
    async with closing_all(LocalProvider) as build:
        yield build


@pytest.fixture
def provider(make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path) -> LocalProvider:
    return make(isolation=isolation, base_dir=sandbox_base)


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A base_dir outside /tmp, where the old provider let sandboxes read each other."""
    base = Path("/var/tmp") / f"containment-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)
