"""PostgreSQL: one store for many machines, through psycopg 3 (the ``postgres`` extra). Each write
locks its rollout's row (``SELECT ... FOR UPDATE``): writes to one rollout are serialized across
every client, different rollouts proceed in parallel. psycopg's blocking API runs in worker
threads, so the store works on asyncio and trio alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ._errors import RecordStoreError
from ._schema import LATEST, ddl
from ._secrets import StoreSecrets

__all__ = ["PostgresBackend"]

_SCHEMA_LOCK = 0x746F6B656E73  # pg_advisory_xact_lock key: one DDL run at a time across clients
INSTALL = "pip install 'llm-sandbox-middleware[postgres]'"


class _Cursor:
    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cursor = self._connection.execute(sql.replace("?", "%s"), params)
        return cursor.fetchall() if cursor.description is not None else []


class PostgresBackend:
    name = "postgresql"

    def __init__(self, url: str, secrets: StoreSecrets) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise RecordStoreError(f"{secrets.shown}: PostgreSQL needs psycopg 3; install it with {INSTALL}") from exc
        self._psycopg = psycopg
        self.errors: tuple[type[Exception], ...] = (psycopg.Error,)
        self._url = url
        self._secrets = secrets
        self._schema_ready = False

    def connect(self) -> Any:
        try:
            connection = self._psycopg.connect(self._url, autocommit=False, connect_timeout=10)
        except self._psycopg.Error as exc:  # the driver's message may quote the URL: its secrets are hidden
            raise RecordStoreError(
                f"{self._secrets.shown}: cannot connect to PostgreSQL ({self._secrets.hide(str(exc))}); check the "
                "URL, the server and its pg_hba.conf"
            ) from None
        if not self._schema_ready:
            try:
                with self.transaction(connection, write=True) as cursor:
                    if not self._made(cursor):  # new, or made by an older client
                        self._create(cursor)
            except BaseException:
                connection.close()
                raise
            self._schema_ready = True
        return connection

    @staticmethod
    def _made(cursor: _Cursor) -> bool:
        """Whether the newest table is there, as of this statement: read from the catalog itself, not
        through the name cache (to_regclass), which keeps within a transaction what it found before."""
        query = (
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = current_schema() AND tablename = ?)"
        )
        ((made,),) = cursor.execute(query, (LATEST,))
        return bool(made)

    @classmethod
    def _create(cls, cursor: _Cursor) -> None:
        """The tables, made once or migrated (every statement is idempotent); other clients wait on the
        advisory lock, then find them made and run none: run again, the DDL would lock tables the
        first client's writers already use (its indexes' ShareLock, ALTER TABLE's exclusive lock)
        until this connect commits, each of many workers connecting at once in turn."""
        cursor.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
        if cls._made(cursor):
            return
        for statement in ddl(blob="BYTEA", float_="DOUBLE PRECISION", int_="BIGINT"):
            cursor.execute(statement)
        # Token arrays barely compress and pglz costs milliseconds per record: store them as they are.
        cursor.execute("ALTER TABLE token_records ALTER COLUMN payload SET STORAGE EXTERNAL")

    @contextmanager
    def transaction(self, connection: Any, *, write: bool) -> Iterator[_Cursor]:
        try:
            yield _Cursor(connection)
        except BaseException:
            connection.rollback()
            raise
        connection.commit()

    def lock_suffix(self) -> str:
        return " FOR UPDATE"

    def is_broken(self, exc: BaseException) -> bool:
        return isinstance(exc, self._psycopg.OperationalError | self._psycopg.InterfaceError)
