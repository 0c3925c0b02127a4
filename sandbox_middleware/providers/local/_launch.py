"""How one LocalProvider command is launched on the host, as data: ``Launch``, read by the exec path.

Every launch starts as ``/bin/sh -c LAUNCH`` (host side, before bwrap and before ``setpriv``), which
in this order: raises its ``oom_score_adj`` (so under memory pressure the kernel kills a sandbox's
process before the trainer), joins the sandbox's cgroups (nothing it starts is ever outside them;
on cgroup v1 by writing ``0`` to each group's ``tasks``, which moves the single-threaded shell
without the kernel's global cgroup lock and its RCU grace period, 8-15 ms after idle through
``cgroup.procs``), sets its rlimits with the shell's ``ulimit`` (soft and hard: a process below
cannot raise a hard limit without ``CAP_SYS_RESOURCE``), then becomes the rest of the command line
(``exec``). All of it is builtins of one shell. Under bwrap what is launched is the sandbox's
command starter, once, at create (``_starter.py``): its commands inherit all of it; without
isolation, each command.

What a sandbox's commands get (its rlimits, whether it has a PTY, its host uid) is decided once, at
create, and kept on the sandbox as a ``Launch``; ``argv`` turns it into the command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAUNCH", "LAUNCH_FAILED", "OOM_SCORE_ADJ", "STARTER_OOM_SCORE_ADJ", "Launch"]

LAUNCH_FAILED = 125  # the exit code of a launch that could not join a cgroup (the sandbox was removed)
OOM_SCORE_ADJ = 1000  # the kernel's most preferred victim: a sandbox's processes die before the trainer
# A command starter's (its commands raise theirs to OOM_SCORE_ADJ): in its sandbox's own memory cgroup
# the kernel kills a command (its namespace) first unless the sandbox is under twice the starter's ~10 MiB,
# and outside it the starter still goes before a trainer smaller than half the memory the kernel weighs.
STARTER_OOM_SCORE_ADJ = 500
LAUNCH = (
    'echo "$1" > /proc/self/oom_score_adj || exit 125; shift; '
    f'while [ "$1" != -- ]; do echo 0 > "$1" || exit {LAUNCH_FAILED}; shift; done; shift; '
    'while [ "$1" != -- ]; do ulimit "$1" "$2" || exit 125; shift 2; done; shift; '
    'exec "$@"'
)

# ulimit's flag and unit per rlimit (dash's and bash's builtins alike).
_ULIMIT = {"nofile": ("-n", 1), "nproc": ("-p", 1), "as": ("-v", 1024), "fsize": ("-f", 512)}


@dataclass(frozen=True)
class Launch:
    """What a sandbox's commands are started with, decided at create.

    ``rlimits`` maps ``nofile``, ``nproc``, ``as`` (bytes) and ``fsize`` (bytes) to the soft and
    hard limit set for every process of a command; ``cgroup_procs`` are the files a command joins its
    cgroups by (``tasks`` on v1, ``cgroup.procs`` on v2); ``pty`` says whether the sandbox asked for a
    terminal (only then does it see
    ``/dev/pts`` and ``/dev/ptmx``); ``uid`` is the host uid its commands run as (None: this
    process's).
    """

    rlimits: tuple[tuple[str, int], ...]
    cgroup_procs: tuple[Path, ...]
    pty: bool
    uid: int | None

    def argv(self, command: Sequence[str], *, oom_score_adj: int = OOM_SCORE_ADJ) -> list[str]:
        """The host command line that starts ``command`` (bwrap's, or the bare one) as this says."""
        limits: list[str] = []
        for name, value in self.rlimits:
            flag, unit = _ULIMIT[name]
            limits += [flag, str(max(1, value // unit))]
        return [
            "/bin/sh", "-c", LAUNCH, "sh", str(oom_score_adj), *map(str, self.cgroup_procs), "--", *limits, "--",
            *command,
        ]  # fmt: skip
