"""Process groups of LocalProvider's commands: each command leads its own, killed whole where no cgroup holds it.

A group outlives its leader while any of its processes lives; once the last one ends, its number is
free and the kernel may give it to any new process (``pid_max`` is 32768 on small machines: reused
within minutes). So a group kept past its leader is killed only while one of its processes is at
least as old as the last time the group was seen alive: a group whose every process is younger
died meanwhile, and its number may be another program's (a Ray raylet, a test runner) - never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

__all__ = ["alive_ticks", "group_alive", "kill_group"]

_TICKS = os.sysconf("SC_CLK_TCK")


def alive_ticks() -> int:
    """Now on the clock of ``/proc/PID/stat``'s start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS)


def _oldest_start(pgid: int) -> int | None:
    """The earliest start time (ticks since boot) of a process in group ``pgid``, or None when it has none."""
    oldest: int | None = None
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            # after the command's name: state, ppid, pgrp, ...; starttime is the 22nd field of the line
            if len(fields) > 19 and int(fields[2]) == pgid:
                start = int(fields[19])
                oldest = start if oldest is None else min(oldest, start)
    return oldest


def kill_group(pgid: int, alive_at: int | None = None) -> None:
    """SIGKILL process group ``pgid``. With ``alive_at`` (``alive_ticks()`` when the group was last seen
    alive, its leader gone), only if one of its processes is that old: else the number is not ours."""
    if alive_at is not None and ((oldest := _oldest_start(pgid)) is None or oldest > alive_at):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
