"""A PostgreSQL cluster of the test's own: ``initdb`` and ``pg_ctl`` as the ``postgres`` user, in a
temporary folder, on a loopback port; stopped and removed after. Skipped with one line where the
server (or psycopg) is absent; ``REQUIRE_POSTGRES=1`` (CI) turns the skip into a failure."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .needs import unavailable

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
INSTALL = "apt-get install postgresql (PostgreSQL 15 server binaries) and pip install -e '.[postgres]'"


def postgres_problem() -> str | None:
    """Why a cluster cannot be started here (the skip reason), or None."""
    if not all(os.access(PG_BIN / name, os.X_OK) for name in ("initdb", "pg_ctl")):
        return f"PostgreSQL server binaries are not in {PG_BIN} (or cannot run): {INSTALL}"
    if importlib.util.find_spec("psycopg") is None:
        return f"psycopg 3 is not installed: {INSTALL}"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return f"there is no postgres user to run the server as: {INSTALL}"
    if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
        return "starting a PostgreSQL cluster needs root (to run it as postgres) or the postgres user"
    return None


def require_postgres() -> None:
    problem = postgres_problem()
    if problem is None:
        return
    unavailable(problem, "REQUIRE_POSTGRES")


def _as_postgres(*command: str) -> list[str]:
    return (
        list(command)
        if os.geteuid() != 0
        else ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *command]
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Start a cluster; yield its URL (``postgresql://postgres@127.0.0.1:PORT/postgres``); stop it."""
    require_postgres()
    root = Path(tempfile.mkdtemp(prefix="records-pg-"))
    user = pwd.getpwnam("postgres")
    os.chown(root, user.pw_uid, user.pw_gid)
    data, port = root / "data", _free_port()
    env = {**os.environ, "LC_ALL": "C"}
    try:
        subprocess.run(
            _as_postgres(
                str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"
            ),
            check=True,
            capture_output=True,
            env=env,
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root} -c max_connections=200"
        subprocess.run(
            _as_postgres(
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(root / "log"),
                "-w",
                "-t",
                "60",
                "start",
            ),
            check=True,
            capture_output=True,
            env=env,
        )
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"),
                capture_output=True,
                env=env,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A new empty database on the cluster at ``url`` (dropped after): tests never share tables."""
    import psycopg

    name = "records_" + os.urandom(6).hex()
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    try:
        yield url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
