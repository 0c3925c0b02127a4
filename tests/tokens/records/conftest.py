"""Fixtures of the record-store tests: a store URL per backend (SQLite file; a database on a
PostgreSQL cluster of the session's own, see ``tests/postgres.py``), on asyncio and trio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.postgres import fresh_database, running_postgres


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[str]:
    with running_postgres() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_cluster: str) -> Iterator[str]:
    with fresh_database(postgres_cluster) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/records.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty store, once per backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/records.db"
        return
    cluster: str = request.getfixturevalue("postgres_cluster")
    with fresh_database(cluster) as url:
        yield url
