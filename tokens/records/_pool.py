"""A small pool of blocking database connections, used from worker threads (anyio), so the
stores run the same on asyncio and trio. One connection serves one transaction at a time."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ._errors import RecordStoreError

__all__ = ["Pool"]

C = TypeVar("C")


class Pool(Generic[C]):
    """Up to ``size`` connections made by ``connect``, handed out one per caller; ``close`` closes them."""

    def __init__(self, connect: Callable[[], C], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[C] = []
        self._open = 0
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self) -> C:
        with self._cond:
            while True:
                if self._closed:
                    raise RecordStoreError("this record store client is closed; open a new one with open_store(url)")
                if self._idle:
                    return self._idle.pop()
                if self._open < self._size:
                    self._open += 1
                    break
                self._cond.wait()
        try:
            return self._connect()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def release(self, connection: C, *, broken: bool = False) -> None:
        with self._cond:
            if broken or self._closed:
                self._open -= 1
                _close(connection)
            else:
                self._idle.append(connection)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for connection in idle:
            _close(connection)


def _close(connection: Any) -> None:
    with contextlib.suppress(Exception):  # closing a broken connection: nothing left to release
        connection.close()
