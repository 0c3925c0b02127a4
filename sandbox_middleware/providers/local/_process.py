"""Process groups of LocalProvider's commands: each command leads its own, killed whole where no cgroup holds it."""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["group_alive", "kill_group"]


def kill_group(pgid: int) -> None:
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
