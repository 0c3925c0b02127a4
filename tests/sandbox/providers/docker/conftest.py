"""Fixtures of the Docker provider's tests: providers built and closed per test, containers removed by label."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from sandbox_middleware import DockerProvider

from ._support import docker_problem, options, remove_containers, require_docker


@pytest.fixture(scope="session", autouse=True)
def _remove_session_containers() -> Iterator[None]:
    """Whatever happens, no container of this session outlives it."""
    yield
    if docker_problem() is None:
        remove_containers()


@pytest.fixture
def docker() -> None:
    require_docker()


@pytest.fixture
async def make(docker: None) -> AsyncIterator[Callable[..., DockerProvider]]:
    """Builds providers (of the daemon and runtime under test, ``_support.options``) and closes every one
    after the test, even a failed one."""
    made: list[DockerProvider] = []

    def build(**given: Any) -> DockerProvider:
        made.append(DockerProvider(**{**options(), **given}))
        return made[-1]

    yield build
    for provider in made:
        await provider.aclose()


@pytest.fixture
def provider(make: Callable[..., DockerProvider]) -> DockerProvider:
    return make()
