"""Per-sandbox cgroups of LocalProvider, in whichever version the machine offers (v1 or v2).

Each sandbox gets a group per controller below this process's own cgroup (``sandbox-middleware/<id>``),
its limits written there; all sandboxes together are capped on the shared parent. Its commands join
before they exec (``JOIN``), and its processes are killed through the group, never by a pid that
could have been reused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..._errors import SandboxLimitError
from ._limits import Limits

__all__ = ["JOIN", "JOIN_FAILED", "CgroupBackend"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PARENT = "sandbox-middleware"
# Joins the sandbox's cgroups, then becomes the command: nothing it starts is ever outside them.
JOIN_FAILED = 125
JOIN = f'while [ "$1" != -- ]; do echo $$ > "$1" || exit {JOIN_FAILED}; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class _Controller:
    """Where one resource's limit is written, per cgroup version."""

    resource: str  # memory | pids | cpu
    v1_hierarchy: str
    write: Callable[[Path, Limits], None]


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _memory_v1(group: Path, limits: Limits) -> None:
    assert limits.memory_bytes is not None
    _write(group / "memory.limit_in_bytes", str(limits.memory_bytes))
    if (group / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
        _write(group / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))


def _memory_v2(group: Path, limits: Limits) -> None:
    _write(group / "memory.max", str(limits.memory_bytes))
    with contextlib.suppress(FileNotFoundError):
        _write(group / "memory.swap.max", "0")


def _pids(group: Path, limits: Limits) -> None:
    _write(group / "pids.max", str(limits.pids))


def _cpu_v1(group: Path, limits: Limits) -> None:
    assert limits.cpu is not None
    _write(group / "cpu.cfs_period_us", "100000")
    _write(group / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu * 100_000))))


def _cpu_v2(group: Path, limits: Limits) -> None:
    assert limits.cpu is not None
    _write(group / "cpu.max", f"{max(1000, int(limits.cpu * 100_000))} 100000")


_V1 = (
    _Controller("memory", "memory", _memory_v1),
    _Controller("pids", "pids", _pids),
    _Controller("cpu", "cpu", _cpu_v1),
)
_V2 = (
    _Controller("memory", "", _memory_v2),
    _Controller("pids", "", _pids),
    _Controller("cpu", "", _cpu_v2),
)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 hierarchy (``""`` for the v2 unified one)."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                own[name] = path
    return own


class CgroupBackend:
    """Per-sandbox cgroups below this process's own, in whichever version the machine offers.

    ``resources`` lists what it can limit. Processes join by writing their pid to ``procs_files``
    before they exec the command, so nothing the command starts is ever outside the group.
    """

    def __init__(self, root: Path = _CGROUP_ROOT) -> None:
        self.version: str | None = None
        self.resources: frozenset[str] = frozenset()
        self._parents: dict[str, Path] = {}
        own = _own_cgroups()
        if (root / "cgroup.controllers").exists():  # pure v2
            self._init_v2(root, own.get("", "/"))
        else:
            self._init_v1(root, own)

    def _init_v1(self, root: Path, own: dict[str, str]) -> None:
        for controller in _V1:
            base = root / controller.v1_hierarchy
            parent = base / own.get(controller.v1_hierarchy, "/").lstrip("/") / _PARENT
            try:
                parent.mkdir(exist_ok=True)
                probe = parent / f"probe-{os.getpid()}-{time.monotonic_ns()}"
                probe.mkdir()
                probe.rmdir()
            except OSError:
                continue
            self._parents[controller.resource] = parent
        self.resources = frozenset(self._parents)
        self.version = "v1" if self._parents else None
        self._cap_all_sandboxes({"memory": "memory.limit_in_bytes", "pids": "pids.max"})

    def _init_v2(self, root: Path, own: str) -> None:
        parent = root / own.lstrip("/") / _PARENT
        try:
            parent.mkdir(exist_ok=True)
            available = set((parent / "cgroup.controllers").read_text().split())
            wanted = {"memory", "pids", "cpu"} & available
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{name}" for name in sorted(wanted)))
        except OSError:
            return
        self._parents = dict.fromkeys(wanted, parent)
        self.resources = frozenset(wanted)
        self.version = "v2" if wanted else None
        self._cap_all_sandboxes({"memory": "memory.max", "pids": "pids.max"})

    def _cap_all_sandboxes(self, files: dict[str, str]) -> None:
        """All sandboxes together may take at most half the machine's pids and 90% of its memory (set on
        the shared parent where nobody has limited it yet), so many sandboxes at their own limits
        cannot exhaust the host either."""
        caps = {"memory": _total_memory() * 9 // 10, "pids": _pid_max() // 2}
        for resource, name in files.items():
            parent = self._parents.get(resource)
            if parent is None or not caps[resource]:
                continue
            with contextlib.suppress(OSError, ValueError):
                current = (parent / name).read_text().strip()
                if current == "max" or int(current) >= 2**62:
                    (parent / name).write_text(str(caps[resource]))

    def create(self, sandbox_id: str, limits: Limits) -> list[Path]:
        """Make the sandbox's groups with its limits; returns their directories."""
        controllers = _V2 if self.version == "v2" else _V1
        groups: dict[Path, None] = {}
        try:
            for controller in controllers:
                parent = self._parents.get(controller.resource)
                if parent is None:
                    continue
                group = parent / sandbox_id
                if group not in groups:
                    parent.mkdir(exist_ok=True)  # another process may have removed an empty one
                    group.mkdir()
                    groups[group] = None
                if _limit_of(controller.resource, limits) is not None:
                    controller.write(group, limits)
        except OSError as exc:
            self.remove(list(groups))
            raise SandboxLimitError(f"cannot set up the cgroups of sandbox {sandbox_id!r}: {exc}") from exc
        return list(groups)

    def groups_of(self, sandbox_id: str) -> list[Path]:
        """The existing groups of sandbox ``sandbox_id`` (derived from its id, never taken from a record)."""
        return [group for group in dict.fromkeys(p / sandbox_id for p in self._parents.values()) if group.is_dir()]

    @staticmethod
    def kill(groups: list[Path]) -> None:
        """SIGKILL every process in ``groups``, repeating until none is left (forks race the reads)."""
        for group in groups:
            with contextlib.suppress(OSError):
                (group / "cgroup.kill").write_text("1")
        for _ in range(100):
            pids = {int(pid) for group in groups for pid in _read_procs(group)}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    @staticmethod
    def remove(groups: list[Path]) -> list[str]:
        """Remove ``groups`` (killing first); returns the ones that could not be removed."""
        CgroupBackend.kill(groups)
        failed = []
        for group in groups:
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # exiting processes leave the group a moment after SIGKILL, or one forked
                    CgroupBackend.kill([group])
                    time.sleep(0.01)
            else:
                failed.append(str(group))
        return failed


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 0


def _read_procs(group: Path) -> list[str]:
    try:
        return (group / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _limit_of(resource: str, limits: Limits) -> float | None:
    return {"memory": limits.memory_bytes, "pids": limits.pids, "cpu": limits.cpu}[resource]
