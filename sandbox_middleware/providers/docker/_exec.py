"""What runs inside the container for each command: the command's shell, its marker, and the kill of its processes.

Each command runs as ``/bin/sh -c COMMAND`` with a marker variable of its own in its environment
(``MARKER=<random>``), which its children inherit. On a timeout a second exec, as the same user,
stops and then kills every process carrying the marker and the process group of each (a child
that cleared its environment but stayed in the group dies too), round after round until none is
left. A command that both clears its environment and leaves its process group escapes this kill;
``close`` and the TTL remove the whole container, and everything in it, in any case.
"""

from __future__ import annotations

import secrets

__all__ = ["KILL", "MARKER", "new_marker"]

MARKER = "SANDBOX_MIDDLEWARE_EXEC"

KILL = r"""
marker="$1"
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
