"""``open_store(url)``: a record store client chosen by its URL."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from ._errors import RecordStoreError
from ._postgres import PostgresBackend
from ._secrets import StoreSecrets
from ._sqlite import SQLiteBackend
from ._store import RecordStore

__all__ = ["open_store"]


def open_store(url: str, *, pool_size: int = 4) -> RecordStore:
    """A new client over the store at ``url`` (synchronous; its methods are async, nothing is
    connected until the first call). Each call gives a fresh client over the same records.

    - ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` (SQLAlchemy's rule: the
      path follows the third slash): one file, created with its tables when missing.
    - ``postgresql://user:password@host:port/database`` (or ``postgres://``): the tables are
      created when missing; needs the ``postgres`` extra (psycopg 3).

    No secret of the URL (the password in the authority; ``password=``, ``sslpassword=`` and libpq's
    other secret parameters in the query) appears in the client's ``repr`` or in any error it raises.
    """
    if not isinstance(url, str):
        raise TypeError(f"open_store: url must be a string such as 'sqlite:///records.db', not {type(url).__name__}")
    secrets = StoreSecrets(url)
    shown = secrets.shown  # the URL without its secrets, for messages and repr
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or not 1 <= pool_size <= 64:
        raise ValueError(f"open_store: pool_size must be an int between 1 and 64, not {pool_size!r}")
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        path = url[len("sqlite:///") :] if url.lower().startswith("sqlite:///") else ""
        if not path or path == ":memory:" or "?" in path:
            raise RecordStoreError(
                f"open_store({shown!r}): a SQLite store is a file: sqlite:///relative.db or "
                "sqlite:////absolute/path.db (no :memory:, no query string)"
            )
        file = Path(path)
        if not file.parent.is_dir():
            raise RecordStoreError(f"open_store({shown!r}): the folder {file.parent} does not exist; create it first")
        return RecordStore(SQLiteBackend(file), url=shown, hide=secrets.hide, pool_size=pool_size)
    if scheme in ("postgresql", "postgres"):
        return RecordStore(PostgresBackend(url, secrets), url=shown, hide=secrets.hide, pool_size=pool_size)
    raise RecordStoreError(f"open_store({shown!r}): unknown scheme {scheme!r}; use sqlite:///FILE or postgresql://...")
