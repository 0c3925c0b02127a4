"""SQLite: the embedded default (standard library). One file in WAL mode, ``synchronous=FULL`` so a
committed record survives a crash of the process and of the machine; several processes on one
host share it (writers take the database lock in turn, readers never wait)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._schema import LATEST, ddl

__all__ = ["SQLiteBackend"]

BUSY_TIMEOUT_MS = 60_000


class _Cursor:
    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._connection.execute(sql, params).fetchall()


class SQLiteBackend:
    name = "sqlite"
    errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        self.path = path

    def connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = FULL")
            present = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
            if not connection.execute(present, (LATEST,)).fetchall():  # new, or made by an older client
                with self.transaction(connection, write=True) as cursor:
                    for statement in ddl(blob="BLOB", float_="REAL", int_="INTEGER"):
                        cursor.execute(statement)
        except BaseException:
            connection.close()
            raise
        return connection

    @contextmanager
    def transaction(self, connection: sqlite3.Connection, *, write: bool) -> Iterator[_Cursor]:
        connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield _Cursor(connection)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def lock_suffix(self) -> str:
        return ""  # BEGIN IMMEDIATE already holds the database's write lock

    def is_broken(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.IntegrityError)
