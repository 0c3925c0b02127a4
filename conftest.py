"""Shared pytest setup: every ``anyio``-marked test runs on asyncio and on trio."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


pytest_plugins = ["sandbox_middleware.testing.fixtures"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos", "the chaos test (tests/test_chaos.py)")
    group.addoption("--chaos-sessions", type=int, default=2000, help="sessions in the chaos test (default 2000)")
    group.addoption("--chaos-concurrency", type=int, default=200, help="sessions at once (default 200)")
    group.addoption("--chaos-seed", type=int, default=None, help="seed to reproduce a chaos run (printed by each run)")
