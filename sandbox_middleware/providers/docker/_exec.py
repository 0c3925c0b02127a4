"""What runs inside the container for each command: the command's shell, its marker, and the kill of its processes.

Each command runs as ``/bin/sh -c COMMAND`` with a marker variable of its own in its environment
(``MARKER=<random>``), which its children inherit. Before it, the shell writes its own pid (which
leads the command's process group) as the first line of stderr, which ``PidReader`` takes off.
On a timeout a second exec, as the same user, first kills that process group (a shell builtin:
no fork is needed, so a command holding every pid of the pids limit is killed too), then stops and
kills every process still carrying the marker and the process group of each, round after round
until none is left. A command that both clears its environment and leaves its process group escapes this kill;
``close`` and the TTL remove the whole container, and everything in it, in any case.

Where the provider runs as root beside the daemon (the container's processes are in this host's
``/proc``), the provider kills from the host instead (``host_victims``): with the container paused
(the freezer: nothing forks or fights back), it reads each process's environment and process group
from ``/proc`` and SIGKILLs those of the command; the in-container kill is the fallback.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from ._streams import OutputCapture

__all__ = ["KILL", "MARKER", "RUN", "PidReader", "cgroup_pids", "host_victims", "new_marker"]

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


def _group(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rpartition(b")")[2].split()[2])


def host_victims(container: str, marker: str, pids: Iterable[int], init: int) -> list[int] | None:
    """The host pids (of ``pids``, the container's, from ``GET /containers/{id}/top``) of one command:
    those carrying ``marker`` and every process in their process groups but the group of the
    container's init (host pid ``init``). None when a pid is not a process of ``container`` in this
    host's ``/proc`` (a daemon elsewhere, or not root): the caller kills from inside instead."""
    groups: dict[int, int] = {}
    marked = marker.encode()
    carriers = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cgroup", "rb") as cgroup:
                if container.encode() not in cgroup.read():
                    return None
            groups[pid] = _group(pid)
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marked in environ.read().split(b"\0"):
                    carriers.add(pid)
        except FileNotFoundError:
            continue  # it ended meanwhile
        except (OSError, ValueError, IndexError):
            return None
    try:
        spared = _group(init)
    except (OSError, ValueError, IndexError):
        return None
    wanted = {groups[pid] for pid in carriers} - {spared}
    return [pid for pid, group in groups.items() if pid in carriers or group in wanted]


def cgroup_pids(init: int) -> list[int] | None:
    """The host pids in the freezer cgroup (cgroup v1; v2: the unified one) of host pid ``init``, read from the
    host's cgroup filesystem: unlike Podman's ``top``, which forks into the container, this works while the
    container is frozen. None where that cgroup is not found here."""
    try:
        with open(f"/proc/{init}/cgroup") as cgroups:
            lines = [line.rstrip("\n").split(":", 2) for line in cgroups]
        path = next((p for _, c, p in lines if "freezer" in c.split(",")), None)
        procs = f"/sys/fs/cgroup/freezer{path}/cgroup.procs" if path else f"/sys/fs/cgroup{lines[0][2]}/cgroup.procs"
        with open(procs) as listed:
            return [int(pid) for pid in listed.read().split()]
    except (OSError, ValueError, IndexError):
        return None


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
