"""Command output kept in a bounded head and tail (``OutputCapture``), and read from pipes into one.

Neither memory nor host disk grows with what a command prints: each stream keeps its first and last
bytes up to ``max_output_bytes`` and counts what it dropped between them.
"""

from __future__ import annotations

import os

import anyio

__all__ = [
    "OutputCapture",
    "drain",
    "pump",
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


async def pump(fd: int, capture: OutputCapture) -> None:
    """Read non-blocking pipe ``fd`` into ``capture`` until end of file."""
    while True:
        await anyio.wait_readable(fd)
        if not drain(fd, capture, budget=1):
            return


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
