"""Exec output: the Engine API's multiplexed stream split into stdout and stderr, each bounded.

Without a TTY the daemon sends frames of an 8-byte header (stream number, three zero bytes, a
big-endian length) and that many bytes. ``Demultiplexer`` takes the body in chunks of any size and
feeds each frame's bytes to the stream's ``OutputCapture`` (LocalProvider's: head, tail and a count
of what was dropped), so memory stays bounded whatever a command prints.
"""

from __future__ import annotations

from typing import Protocol

from .._common._output import OutputCapture

__all__ = ["Demultiplexer", "OutputCapture", "Sink"]


class Sink(Protocol):
    def feed(self, data: bytes) -> None: ...


_HEADER = 8


class Demultiplexer:
    """Feeds the frames of a multiplexed exec stream to ``stdout`` and ``stderr``."""

    def __init__(self, stdout: Sink, stderr: Sink) -> None:
        self._captures: dict[int, Sink] = {1: stdout, 2: stderr}
        self._header = bytearray()
        self._stream = 1
        self._left = 0  # bytes of the current frame still to come

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._left:
                part, view = view[: self._left], view[self._left :]
                self._left -= len(part)
                capture = self._captures.get(self._stream)
                if capture is not None:  # stdin (0) is never attached; anything else is dropped
                    capture.feed(bytes(part))
                continue
            need = _HEADER - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) == _HEADER:
                self._stream = self._header[0]
                self._left = int.from_bytes(self._header[4:8], "big")
                self._header.clear()
