"""What runs inside the container for each command: the command's shell, its marker, and the kill of its processes.

Each command runs as ``/bin/sh -c COMMAND`` with a marker variable of its own in its environment
(``MARKER=<random>``), which its children inherit. Before it, the shell writes its own pid (which
leads the command's process group) as the first line of stderr, which ``PidReader`` takes off.
On a timeout a second exec, as the same user, first kills that process group (a shell builtin:
no fork is needed, so a command holding every pid of the pids limit is killed too), then stops and
kills every process still carrying the marker and the process group of each, round after round
until none is left. A command that both clears its environment and leaves its process group escapes this kill;
``close`` and the TTL remove the whole container, and everything in it, in any case.
"""

from __future__ import annotations

import secrets

from ._streams import OutputCapture

__all__ = ["KILL", "MARKER", "RUN", "PidReader", "new_marker"]

MARKER = "SANDBOX_MIDDLEWARE_EXEC"

RUN = 'echo "$$" >&2; exec /bin/sh -c "$1"'
"""The wrapper: ``/bin/sh -c RUN sh COMMAND`` (``exec`` keeps the pid, so it leads the group)."""

KILL = r"""
marker="$1"
[ -n "$2" ] && kill -KILL -- "-$2" 2>/dev/null
for round in 1 2 3 4 5 6 7 8 9 10; do
  found=""
  for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    [ "$pid" = "$$" ] && continue
    if tr '\0' '\n' < "$dir/environ" 2>/dev/null | grep -qxF "$marker"; then found="$found $pid"; fi
  done
  [ -n "$found" ] || exit 0
  for pid in $found; do kill -STOP "$pid" 2>/dev/null; done
  for pid in $found; do
    group=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f3)
    [ -n "$group" ] && [ "$group" != 1 ] && kill -KILL -- "-$group" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
  done
done
exit 1
"""


def new_marker() -> str:
    return f"{MARKER}={secrets.token_hex(16)}"


class PidReader:
    """The stderr capture of a wrapped command: its first line is the command's pid, the rest its stderr."""

    def __init__(self, capture: OutputCapture) -> None:
        self._capture = capture
        self._first = bytearray()
        self.pid: int | None = None
        self._done = False

    def feed(self, data: bytes) -> None:
        if not self._done:
            self._first += data
            line, newline, rest = bytes(self._first).partition(b"\n")
            if not newline:
                if len(self._first) > 32:  # not the wrapper's line: keep it all
                    self._done = True
                    self._capture.feed(bytes(self._first))
                return
            self._done = True
            if line.isdigit():
                self.pid = int(line)
            else:
                rest = bytes(self._first)
            data = rest
        if data:
            self._capture.feed(data)
