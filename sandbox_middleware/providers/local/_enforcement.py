"""How LocalProvider enforces each limit on this machine, chosen once per provider (``Enforcement``).

cgroups v1 or v2 (``_cgroups.py``) or rlimits for memory, processes and CPU; a bounded tmpfs
(``_mounts.py``) or RLIMIT_FSIZE for disk; the TTL watchdog (``_watchdog.py``). ``launch`` says how
one sandbox's commands start under them, ``mechanisms`` reports them, and a limit the chosen
mechanism cannot enforce is refused with ``SandboxLimitError`` when asked for explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..._errors import SandboxLimitError
from .._common._limits import Limits
from .._common._uids import UidLease, lease_uid
from ._bwrap import BwrapCommand
from ._cgroups import CgroupBackend, file_max
from ._launch import OOM_SCORE_ADJ, STARTER_OOM_SCORE_ADJ, Launch

__all__ = ["Enforcement"]

_FILE_SHARE = 4  # all sandboxes' open files together: at most a quarter of the host's file table


@dataclass(frozen=True)
class Enforcement:
    """What enforces the limits of a provider's sandboxes: its cgroups (None: rlimits only), whether
    it may mount a tmpfs, its bubblewrap command (None: ``isolation="none"``), and its options."""

    cgroups: CgroupBackend | None
    tmpfs: bool
    bwrap: BwrapCommand | None
    sandbox_uid: int | None
    nofile: int
    defaults: Mapping[str, float | None]
    max_output: int

    @property
    def shared_uid(self) -> bool:
        """Whether all sandboxes' commands run as one uid (this process's, or ``sandbox_uid``)."""
        return self.bwrap is None or not self.bwrap.drops_privileges or self.sandbox_uid is not None

    @property
    def commands_run_as_root(self) -> bool:
        """Whether commands run as host root (RLIMIT_NPROC does not bind root)."""
        return os.geteuid() == 0 and not (self.bwrap is not None and self.bwrap.drops_privileges)

    def new_uid(self) -> tuple[int | None, UidLease | None]:
        """The host uid a new sandbox's commands run as, and its lease: its own (leased host-wide, so
        no two live sandboxes and no host account share it), ``sandbox_uid`` if given (shared by all,
        no lease); None: this process's."""
        if self.bwrap is None or not self.bwrap.drops_privileges:
            return None, None
        if self.sandbox_uid is not None:
            return self.sandbox_uid, None
        lease = lease_uid()
        return lease.uid, lease

    def launch(self, limits: Limits, cgroups: Sequence[Path], uid: int | None) -> Launch:
        """How the commands of a sandbox with these limits and groups start (see ``_launch.py``)."""
        cgroup = self.cgroups.resources if self.cgroups is not None else frozenset()
        nofile = self.nofile
        if limits.pids is not None and "pids" not in cgroup:  # RLIMIT_NPROC (per uid) bounds the processes
            nofile = max(16, min(nofile, file_max() // (_FILE_SHARE * limits.pids)))
        rlimits = [("nofile", nofile)]
        if limits.memory_bytes is not None and "memory" not in cgroup:
            rlimits.append(("as", limits.memory_bytes))
        if limits.pids is not None and "pids" not in cgroup and not self.commands_run_as_root:
            rlimits.append(("nproc", limits.pids))
        if limits.disk_bytes is not None and not self.tmpfs:
            rlimits.append(("fsize", limits.disk_bytes))
        joins = self.cgroups.join_files(cgroups) if self.cgroups is not None else ()
        return Launch(tuple(rlimits), joins, pty=False, uid=uid)

    def refuse_unenforceable(self, limits: Limits) -> None:
        cgroup = self.cgroups.resources if self.cgroups is not None else frozenset()
        refused = []
        if limits.cpu is not None and "cpu" not in cgroup:
            refused.append("cpu (needs the cgroup cpu controller)")
        if limits.pids is not None and "pids" not in cgroup and self.commands_run_as_root:
            refused.append("pids (needs the cgroup pids controller when running as root; or pass pids=None)")
        if limits.disk_bytes is not None and not self.tmpfs and "disk_gib" in limits.explicit:
            refused.append("disk_gib (needs permission to mount a tmpfs)")
        if refused:
            raise SandboxLimitError(
                f"LocalProvider cannot enforce {', '.join(refused)} on this machine; drop the limit or run where "
                f"it can be enforced (in force here: {self.mechanisms})"
            )

    @property
    def mechanisms(self) -> dict[str, str]:
        """How each limit is enforced on this machine: only what is enforced, and where a limit is off
        by default (None), that it is."""
        cgroup = self.cgroups.resources if self.cgroups is not None else frozenset()
        version = f"cgroup {self.cgroups.version}" if self.cgroups is not None else ""
        root = self.commands_run_as_root

        def limit(name: str, mechanism: str) -> str:
            if self.defaults[name] is not None or mechanism == "not enforced":
                return mechanism
            return f"not limited by default ({name}=None); {mechanism} when spec.resources sets it"

        memory = version if "memory" in cgroup else "rlimit RLIMIT_AS (per process)"
        report = {
            "memory": limit("memory_mib", memory),
            "pids": limit(
                "pids",
                version if "pids" in cgroup else ("not enforced" if root else "rlimit RLIMIT_NPROC (per uid)"),
            ),
            "cpu": limit("cpu", version if "cpu" in cgroup else "not enforced"),
            "disk": limit("disk_gib", self._disk_report()),
            "memory budget": self._budget_report(),
            "tcp buffers": {
                "v1": "cgroup v1 memory.kmem.tcp.limit_in_bytes, memory_mib per sandbox (besides its memory)",
                "v2": "cgroup v2 memory.max (socket buffers are charged to the sandbox's memory)",
            }.get(self.cgroups.version or "", "not limited")
            if "memory" in cgroup and self.cgroups is not None
            else "not limited",
            "open files": self._files_report(),
            "oom": (
                f"oom_score_adj {OOM_SCORE_ADJ}: the kernel kills a sandbox's processes before the trainer"
                + (f" (its command starter: {STARTER_OOM_SCORE_ADJ})" if self.bwrap is not None else "")
            ),
            "ttl": "watchdog thread (SIGKILL)",
            "output": f"pipes, {self.max_output} bytes kept per stream",
            "isolation": self._isolation_report(),
        }
        if self.bwrap is not None:
            report["pty"] = "none: no /dev/pts, no /dev/ptmx"
        return report

    def _disk_report(self) -> str:
        if not self.tmpfs:
            return "rlimit RLIMIT_FSIZE (per file)"
        if self.bwrap is None:
            return "tmpfs size: the sandbox directory and its TMPDIR (not the host's /tmp, which commands can reach)"
        return "tmpfs size: the sandbox directory, its /tmp and /dev/shm"

    def _budget_report(self) -> str:
        budget = self.cgroups.memory_budget() if self.cgroups is not None else None
        if budget is None:
            return "none (no memory cgroup): sandboxes together are not bounded"
        return f"{budget.describe()}; a create beyond it is refused"

    def _files_report(self) -> str:
        cgroup = self.cgroups.resources if self.cgroups is not None else frozenset()
        if self.cgroups is not None and "pids" in cgroup:
            together = self.cgroups.all_pids
            how = f"all sandboxes together at most {together} processes (cgroup {self.cgroups.version} pids)"
        elif self.defaults["pids"] is not None and not self.commands_run_as_root and self.shared_uid:
            together = int(self.defaults["pids"])
            how = f"all sandboxes and this user together at most {together} processes (RLIMIT_NPROC, per uid)"
        elif self.defaults["pids"] is not None and not self.commands_run_as_root:
            per = int(self.defaults["pids"])
            nofile = self.launch(Limits(None, per, None, None), (), None).rlimits[0][1]
            return (
                f"RLIMIT_NOFILE {nofile} per process, RLIMIT_NPROC {per} per sandbox uid: at most {nofile * per} "
                "open files per sandbox; not bounded for all sandboxes together (no pids cgroup)"
            )
        else:
            return f"RLIMIT_NOFILE {self.nofile} per process; processes not bounded, so files are not either"
        nofile = self.launch(Limits(None, together, None, None), (), None).rlimits[0][1]
        return (
            f"RLIMIT_NOFILE {nofile} per process; {how}: at most {nofile * together} open files, "
            f"of fs.file-max {file_max()}"
        )

    def _isolation_report(self) -> str:
        if self.bwrap is None:
            return "none (not a security boundary)"
        if not self.bwrap.drops_privileges:
            who = "this process's uid"
        elif self.sandbox_uid is not None:
            who = f"host uid {self.sandbox_uid}"
        else:
            who = "an unprivileged host uid of its own per sandbox"
        seccomp = "seccomp filter" if self.bwrap.seccomp else "no seccomp filter (unknown architecture)"
        return f"bubblewrap as {who}, no capabilities, {seccomp}"
