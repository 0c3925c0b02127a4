"""Who owns a sandbox: a process named across pid reuse and PID namespaces (``Owner``), and the
metadata keys that carry it and its run (``RUN_KEY``). ``OwnershipMiddleware`` stamps them; ``reap``,
the admission ledger and LocalProvider's records (its sandboxes', its spares' and its half-made
ones' makers) read them back, and ``Owner.liveness`` is the one place that decides whether one lives.

A pid names a process only in its own PID namespace, and the hostname does not name that namespace:
a trainer in a container of the host's network (the usual way on Kubernetes) has the host's
hostname and pids of its own. So an owner is found alive or dead only by a process of the same
host, boot (``/proc/sys/kernel/random/boot_id``) and PID namespace (``/proc/self/ns/pid``), through
its pid and start time; from anywhere else its liveness is unknown, and ``reap`` leaves its
sandboxes alone (unless forced) and reports them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = ["EXPIRES_KEY", "RUN_KEY", "Liveness", "Owner", "boot_id", "expired"]

RUN_KEY = "sandbox_middleware.run_id"
EXPIRES_KEY = "sandbox_middleware.expires"
"""A snapshot's expiry, seconds since the epoch: ``reap`` removes it once past, whoever owns it (no
provider ends a snapshot at a TTL, as it ends a sandbox)."""
_HOST_KEY = "sandbox_middleware.owner.host"
_PID_KEY = "sandbox_middleware.owner.pid"
_STARTED_KEY = "sandbox_middleware.owner.started"
_PIDNS_KEY = "sandbox_middleware.owner.pidns"


def expired(metadata: Mapping[str, str], now: float) -> bool:
    """Whether ``metadata`` carries an expiry (``EXPIRES_KEY``) that ``now`` is past; one that is no
    number is no expiry."""
    try:
        return float(metadata[EXPIRES_KEY]) < now
    except (KeyError, ValueError, TypeError):
        return False


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def pid_namespace() -> str | None:
    """This process's PID namespace as the kernel names it (``pid:[4026531836]``), None where unseen."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_ticks(pid: int | str) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if fields[0] != "Z" else None  # zombies are dead


def _proc_shows_own_namespace() -> bool:
    """Whether ``/proc`` here is of this process's PID namespace (its pids are the ones we see)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


class Liveness(NamedTuple):
    """Whether an owner lives: True, False, or None where this process cannot tell; and why not."""

    alive: bool | None
    why: str


@dataclass(frozen=True)
class Owner:
    """A process, identified across pid reuse: host, pid, its start time on this boot, and its PID
    namespace (None in stamps written before namespaces were stamped, or where /proc hides it)."""

    host: str
    pid: int
    started: str  # "<boot id>:<start ticks>"
    pidns: str | None = None

    @classmethod
    def current(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), f"{boot_id()}:{_start_ticks('self')}", pid_namespace())

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> Owner | None:
        try:
            owner = cls(metadata[_HOST_KEY], int(metadata[_PID_KEY]), metadata[_STARTED_KEY])
        except (KeyError, ValueError, TypeError):
            return None
        pidns = metadata.get(_PIDNS_KEY)
        return owner if not isinstance(pidns, str) else cls(owner.host, owner.pid, owner.started, pidns)

    def metadata(self) -> dict[str, str]:
        stamp = {_HOST_KEY: self.host, _PID_KEY: str(self.pid), _STARTED_KEY: self.started}
        return stamp if self.pidns is None else {**stamp, _PIDNS_KEY: self.pidns}

    def liveness(self) -> Liveness:
        """Alive or dead where this process shares the owner's host, boot and PID namespace; else unknown."""
        if self.host != socket.gethostname():
            return Liveness(None, f"owner {self} is on another host")
        boot, _, ticks = self.started.partition(":")
        if boot != boot_id():
            return Liveness(None, f"owner {self} ran on boot {boot}, not this one (another machine, or a reboot)")
        here = pid_namespace()
        if self.pidns is not None and self.pidns != here:
            return Liveness(
                None, f"owner {self} runs in PID namespace {self.pidns}, this process in {here or 'an unseen one'}"
            )
        if not _proc_shows_own_namespace():
            return Liveness(None, f"this process's /proc is of another PID namespace; owner {self} cannot be seen")
        if _start_ticks(self.pid) == ticks:
            return Liveness(True, f"owner {self} is alive")
        if self.pidns is None:  # a stamp without its namespace: a pid missing here may live elsewhere
            return Liveness(None, f"owner {self} was stamped without its PID namespace, and is not in this one")
        return Liveness(False, f"owner {self} is no longer alive")

    def alive(self) -> bool | None:
        """True or False where it can be told (see ``liveness``); None where it cannot."""
        return self.liveness().alive

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"
