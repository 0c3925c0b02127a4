"""The admission layer's shared state, one ``Ledger``, and where it lives: this process, the host, Ray.

A ``Ledger`` is plain data and pure arithmetic: one token bucket (GCRA: a theoretical arrival time
``tat``), the provider's pause (``paused_until``, from a Retry-After) and the slots taken, by kind
(``"held"``, ``"creating"``) and owner process. The three backends run exactly this code, so the
semantics are the same wherever the state is kept:

- ``ProcessBackend``: a ``Ledger`` in memory (one process);
- ``HostBackend``: the ledger as one row of a SQLite file, read and written in one ``BEGIN IMMEDIATE``
  transaction per operation (every process of the host that names the same file and key);
- ``RayBackend`` (``_admission_ray``): the ledger in one small named Ray actor (a cluster).

Times are ``time.monotonic()`` of the process (or of the actor) that applies the operation; on Linux
that clock is the same for every process of the host. Slots of an owner process found dead on this
host are freed when a limit is reached, so a crashed worker does not keep its slots.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio.to_thread

from ..._errors import SandboxAdmissionError
from ..._owner import Owner, boot_id

__all__ = ["Backend", "HostBackend", "Ledger", "ProcessBackend", "owner_key"]

BACKEND_TIMEOUT_S = 30.0
"""How long one operation on a shared ledger may take (a locked SQLite file, an unreachable actor)."""


def owner_key(owner: Owner | None = None) -> str:
    owner = owner or Owner.current()
    return f"{owner.host}|{owner.pid}|{owner.started}|{owner.pidns or ''}"


def _dead(key: str) -> bool:
    host, pid, started, pidns = [*key.split("|", 3), "", "", ""][:4]
    try:
        return Owner(host, int(pid), started, pidns or None).alive() is False
    except ValueError:
        return False


@dataclass
class Ledger:
    """One admission key's state (see the module docstring); every method is one atomic step."""

    tat: float = 0.0
    paused_until: float = 0.0
    slots: dict[str, dict[str, int]] = field(default_factory=dict)

    def take(self, now: float, rate: float | None, burst: int) -> tuple[float, str | None]:
        """Take a create token: ``(0, None)``, or how long to wait and why (``"retry_after"``, ``"rate"``)."""
        if self.paused_until > now:
            return self.paused_until - now, "retry_after"
        if rate is None:
            return 0.0, None
        interval = 1.0 / rate
        tat = min(max(self.tat, now), now + burst * interval)  # a tat beyond that: a clock reset
        allowed_at = tat - (burst - 1) * interval
        if allowed_at > now:
            return allowed_at - now, "rate"
        self.tat = tat + interval
        return 0.0, None

    def pause(self, now: float, seconds: float) -> None:
        self.paused_until = max(self.paused_until, now + seconds)

    def acquire(self, kind: str, owner: str, limit: int, *, dead: Callable[[str], bool] = _dead) -> bool:
        """Take a ``kind`` slot for ``owner`` if at most ``limit`` are taken then (dead owners' freed first)."""
        return self.acquire_many(kind, owner, limit, 1, dead=dead)

    def acquire_many(
        self, kind: str, owner: str, limit: int, count: int, *, dead: Callable[[str], bool] = _dead
    ) -> bool:
        """Take ``count`` ``kind`` slots at once, or none (a group's: ``_groups.py``). An operation of its
        own, not a new argument of ``acquire``: a Ray actor of an older version, still running in a
        long-lived cluster, refuses it by name rather than read the count as something else."""
        counts = self.slots.setdefault(kind, {})
        if sum(counts.values()) + count > limit:
            for other in [key for key in counts if key != owner and dead(key)]:
                self.forget(other)
            if sum(counts.values()) + count > limit:
                return False
        counts[owner] = counts.get(owner, 0) + count
        return True

    def release(self, kind: str, owner: str, count: int = 1) -> None:
        counts = self.slots.get(kind, {})
        left = counts.get(owner, 0) - count
        if left > 0:
            counts[owner] = left
        else:
            counts.pop(owner, None)

    def forget(self, owner: str) -> None:
        """Free every slot of ``owner`` (it closed its layer, or died)."""
        for counts in self.slots.values():
            counts.pop(owner, None)

    def taken(self, kind: str) -> int:
        return sum(self.slots.get(kind, {}).values())

    def dump(self) -> str:
        return json.dumps({"tat": self.tat, "paused_until": self.paused_until, "slots": self.slots})

    @classmethod
    def load(cls, text: str) -> Ledger:
        data = json.loads(text)
        return cls(float(data["tat"]), float(data["paused_until"]), {k: dict(v) for k, v in data["slots"].items()})


def apply(ledger: Ledger, operation: str, args: tuple[Any, ...]) -> Any:
    """Run one named operation on ``ledger`` with ``now`` first where it needs one (every backend's dispatch)."""
    now = time.monotonic()
    if operation == "take":
        return ledger.take(now, *args)
    if operation == "pause":
        return ledger.pause(now, *args)
    method: Callable[..., Any] = getattr(ledger, operation)  # acquire, acquire_many, release, forget, taken
    return method(*args)


class Backend(Protocol):
    """Where a ledger lives; ``call`` applies one operation atomically. ``shared`` backends are polled."""

    shared: bool

    async def call(self, operation: str, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


class ProcessBackend:
    """The ledger in this process's memory."""

    shared = False

    def __init__(self) -> None:
        self.ledger = Ledger()

    async def call(self, operation: str, *args: Any) -> Any:
        return apply(self.ledger, operation, args)

    async def aclose(self) -> None:
        pass


def default_host_path() -> Path:
    """Where the host's ledgers are kept by default: one SQLite file per user in the temp directory."""
    return Path(tempfile.gettempdir()) / f"sandbox-middleware-admission-{os.getuid()}.sqlite"


class HostBackend:
    """The ledger as a row of a SQLite file, shared by every process of this host that names it.

    Each operation is one ``BEGIN IMMEDIATE`` transaction in a worker thread (SQLite's own file
    lock serialises the processes); the row remembers the boot it was written on, and a ledger of
    an earlier boot (its monotonic times meaningless now) starts afresh.
    """

    shared = True

    def __init__(self, path: Path, key: str) -> None:
        self.path = path
        self.key = key
        self._boot = boot_id()
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"HostBackend({str(self.path)!r}, key={self.key!r})"

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            connection = sqlite3.connect(
                self.path, timeout=BACKEND_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            connection.execute(
                "CREATE TABLE IF NOT EXISTS admission (key TEXT PRIMARY KEY, boot TEXT NOT NULL, ledger TEXT NOT NULL)"
            )
            self._connection = connection
        return self._connection

    def _apply(self, operation: str, args: tuple[Any, ...]) -> Any:
        with self._lock:
            connection = self._connect()
            connection.execute("BEGIN IMMEDIATE")
            try:
                row = connection.execute("SELECT boot, ledger FROM admission WHERE key = ?", (self.key,)).fetchone()
                ledger = Ledger.load(row[1]) if row is not None and row[0] == self._boot else Ledger()
                result = apply(ledger, operation, args)
                connection.execute(
                    "INSERT OR REPLACE INTO admission (key, boot, ledger) VALUES (?, ?, ?)",
                    (self.key, self._boot, ledger.dump()),
                )
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            return result

    async def call(self, operation: str, *args: Any) -> Any:
        try:
            return await anyio.to_thread.run_sync(self._apply, operation, args)
        except (sqlite3.Error, OSError, ValueError, KeyError) as exc:
            raise SandboxAdmissionError(
                f"admission: the host's shared limiter {self.path} (key {self.key!r}) failed during {operation}: "
                f"{exc}; check that the file is writable by every process sharing it, or use shared: process"
            ) from exc

    async def aclose(self) -> None:
        # In a worker thread: the lock may be held by an operation waiting on SQLite's file lock.
        await anyio.to_thread.run_sync(self._close)

    def _close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
