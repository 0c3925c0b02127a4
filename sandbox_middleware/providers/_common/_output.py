"""Command output kept in a bounded head and tail (``OutputCapture``), and read from pipes into one.

Neither memory nor host disk grows with what a command prints: each stream keeps its first and last
bytes up to ``max_output_bytes`` and counts what it dropped between them. ``OutputPump`` reads a
command's pipes while its caller waits for something else (its answer, its exit), in the caller's
own task: one epoll set of the pipes, no task group to make and cancel on every command.
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence

import anyio

__all__ = [
    "OutputCapture",
    "OutputPump",
    "drain",
]


class OutputCapture:
    """One output stream, bounded: the first and last ``limit // 2`` bytes and a count of those dropped."""

    def __init__(self, limit: int) -> None:
        self._head_limit = limit - limit // 2
        self._tail_limit = limit // 2
        self._head = bytearray()
        self._tail = bytearray()
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            excess = len(self._tail) - self._tail_limit
            if excess > 0:
                del self._tail[:excess]  # O(1): bytearray drops from the front without moving the rest
                self.dropped += excess

    def text(self) -> str:
        if not self.dropped:
            return (self._head + self._tail).decode("utf-8", errors="replace")
        marker = f"\n[... {self.dropped} bytes truncated (max_output_bytes); head and tail kept ...]\n"
        head = self._head.decode("utf-8", errors="replace")
        return head + marker + self._tail.decode("utf-8", errors="replace")


def drain(fd: int, capture: OutputCapture, *, budget: int) -> bool:
    """Read what ``fd`` holds now (at most ``budget`` chunks); False at end of file."""
    for _ in range(budget):
        try:
            data = os.read(fd, 1 << 20)
        except BlockingIOError:
            return True
        if not data:
            return False
        capture.feed(data)
    return True


class OutputPump:
    """Non-blocking pipes read into their captures, each until end of file, while the caller waits on
    another descriptor (``wait_readable``) or only for them (``pump``): one epoll set, in the caller's
    task. Linux only, as LocalProvider is; ``close`` it."""

    def __init__(self, streams: Sequence[tuple[int, OutputCapture]]) -> None:
        self._captures = dict(streams)
        self._poller = select.epoll()
        try:
            for fd in self._captures:
                self._poller.register(fd, select.EPOLLIN)
        except BaseException:
            self._poller.close()
            raise

    async def wait_readable(self, fd: int) -> None:
        """Until ``fd`` is readable; the pipes are read meanwhile."""
        self._poller.register(fd, select.EPOLLIN)
        try:
            while fd not in await self._read():
                pass
        finally:
            self._poller.unregister(fd)

    async def pump(self) -> None:
        """Read the pipes until each is at end of file."""
        while self._captures:
            await self._read()

    async def _read(self) -> set[int]:
        """Wait until a descriptor of the set is readable, read the pipes that are (``budget=1`` chunk
        each), and return the others that are."""
        await anyio.wait_readable(self._poller.fileno())
        others = set()
        for fd, _ in self._poller.poll(0):
            capture = self._captures.get(fd)
            if capture is None:
                others.add(fd)
            elif not drain(fd, capture, budget=1):
                self._poller.unregister(fd)
                del self._captures[fd]
        return others

    def close(self) -> None:
        self._poller.close()
