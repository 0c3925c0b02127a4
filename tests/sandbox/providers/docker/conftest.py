"""Fixtures of the Docker provider's tests: providers built and closed per test, containers removed by label."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from sandbox_middleware import DockerProvider
from tests.providers import closing_all

from ._support import (
    docker_problem,
    free_claims,
    options,
    remove_containers,
    remove_host_snapshots,
    remove_images,
    require_docker,
)


@pytest.fixture(scope="session", autouse=True)
def _remove_session_containers() -> Iterator[None]:
    """Whatever happens, no container or snapshot image of this session outlives it, nor the uid lease
    claimed for a container."""
    yield
    if docker_problem() is None:
        remove_containers()
        remove_images()
        remove_host_snapshots()
        free_claims()


@pytest.fixture
def docker() -> None:
    require_docker()


@pytest.fixture
async def make(docker: None) -> AsyncIterator[Callable[..., DockerProvider]]:
    """Builds providers (of the daemon and runtime under test, ``_support.options``) and closes every one
    after the test, even a failed one."""
    async with closing_all(lambda **given: DockerProvider(**{**options(), **given})) as build:
        yield build


@pytest.fixture
def provider(make: Callable[..., DockerProvider]) -> DockerProvider:
    return make()
