"""Shared pytest setup: every ``anyio``-marked test runs on asyncio and on trio."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


pytest_plugins = ["sandbox_middleware.testing.fixtures"]
