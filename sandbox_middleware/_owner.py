"""Who owns a sandbox: a process named across pid reuse (``Owner``), and the metadata keys that carry
it and its run (``RUN_KEY``). ``OwnershipMiddleware`` stamps them; ``reap``, the admission ledger and
LocalProvider's records read them back.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RUN_KEY", "Owner", "boot_id"]

RUN_KEY = "sandbox_middleware.run_id"
_HOST_KEY = "sandbox_middleware.owner.host"
_PID_KEY = "sandbox_middleware.owner.pid"
_STARTED_KEY = "sandbox_middleware.owner.started"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if fields[0] != "Z" else None  # zombies are dead


@dataclass(frozen=True)
class Owner:
    """A process, identified across pid reuse: host, pid, and its start time on this boot."""

    host: str
    pid: int
    started: str  # "<boot id>:<start ticks>"

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, f"{boot_id()}:{_start_ticks(pid)}")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> Owner | None:
        try:
            return cls(metadata[_HOST_KEY], int(metadata[_PID_KEY]), metadata[_STARTED_KEY])
        except (KeyError, ValueError):
            return None

    def metadata(self) -> dict[str, str]:
        return {_HOST_KEY: self.host, _PID_KEY: str(self.pid), _STARTED_KEY: self.started}

    def alive(self) -> bool | None:
        """True or False on this host; None where it cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        return f"{boot_id()}:{_start_ticks(self.pid)}" == self.started

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"
