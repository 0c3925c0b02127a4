"""Per-sandbox cgroups of LocalProvider, in whichever version the machine offers (v1 or v2).

Each sandbox gets a group per controller below this process's own cgroup (``sandbox-middleware/<id>``),
its limits written there; all sandboxes together are capped on the shared parent (memory: the
budget of ``memory_budget``; processes: what keeps the open-file table safe). Its commands join
before they exec (``_launch.py``), and its processes are killed through the group, never by a pid
that could have been reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..._errors import SandboxLimitError
from .._common._limits import Limits, file_max

__all__ = ["MEMORY_RESERVE", "CgroupBackend", "MemoryBudget", "file_max"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PARENT = "sandbox-middleware"
_UNLIMITED = 2**62
_FREEZE_S = 1.0  # how long a freeze may take before a snapshot gives up on it (idle processes take microseconds)
_KILL_ROUND_S = 0.005  # one round of kill: the processes read are waited for this long at most
_MiB = 1 << 20
MEMORY_RESERVE = (256 * _MiB, 10)  # kept free for the trainer: the larger of 256 MiB and 1/10 of the tightest limit


@dataclass(frozen=True)
class _Controller:
    """Where one resource's limit is written, per cgroup version."""

    resource: str  # memory | pids | cpu | freezer (no limit: it stops the sandbox still for a snapshot)
    v1_hierarchy: str
    write: Callable[[Path, Limits], None] | None


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _memory_v1(group: Path, limits: Limits) -> None:
    assert limits.memory_bytes is not None
    _write(group / "memory.limit_in_bytes", str(limits.memory_bytes))
    if (group / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
        _write(group / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
    # v1 charges socket buffers to a counter of their own, unlimited unless set (v2 charges them to memory.max)
    _write(group / "memory.kmem.tcp.limit_in_bytes", str(limits.memory_bytes))


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
    _Controller("freezer", "freezer", None),  # v2 freezes every group (cgroup.freeze)
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


@dataclass(frozen=True)
class _Files:
    """The names of a version's memory files."""

    limit: str
    usage: str
    inactive: str  # the memory.stat key of reclaimable file cache, left out of a working set


_MEMORY_FILES = {
    "v1": _Files("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    "v2": _Files("memory.max", "memory.current", "inactive_file"),
}


@dataclass(frozen=True)
class MemoryBudget:
    """The memory all sandboxes together may be given: ``headroom`` minus ``reserve``.

    ``headroom`` is the least, over the provider's own cgroup, its ancestors and the machine, of the
    limit minus what everything but the sandboxes uses now (the working set: usage without inactive
    file cache); ``where`` names that tightest level and ``limit`` is its limit.
    """

    total: int
    headroom: int
    reserve: int
    limit: int
    where: str

    def describe(self) -> str:
        return (
            f"{self.total // _MiB} MiB for all sandboxes together (the tightest limit is {self.limit // _MiB} MiB at "
            f"{self.where}; {self.headroom // _MiB} MiB of it is not used by the trainer and its other processes, "
            f"less a reserve of {self.reserve // _MiB} MiB)"
        )


class CgroupBackend:
    """Per-sandbox cgroups below this process's own, in whichever version the machine offers.

    ``resources`` lists what it can limit. Processes join by writing their pid to the groups'
    ``cgroup.procs`` before they exec the command, so nothing the command starts is ever outside
    the group. ``all_pids`` is the cap on the processes of all sandboxes together, chosen so that
    ``nofile`` open files each keep the host's file table (``fs.file-max``) at most a quarter full.
    """

    def __init__(self, root: Path = _CGROUP_ROOT, *, nofile: int = 256) -> None:
        self.version: str | None = None
        self.resources: frozenset[str] = frozenset()
        self._parents: dict[str, Path] = {}
        self._root = root
        self._own = _own_cgroups()
        self._lock = threading.Lock()
        self.all_pids = max(1, min(_pid_max() // 2, file_max() // (4 * nofile)))
        if (root / "cgroup.controllers").exists():  # pure v2
            self._init_v2(root, self._own.get("", "/"))
        else:
            self._init_v1(root, self._own)

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
        self.resources = frozenset(self._parents) - {"freezer"}
        self.version = "v1" if self.resources else None
        self._cap_pids()

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
        self._cap_pids()

    def _cap_pids(self) -> None:
        """All sandboxes together may run at most ``all_pids`` processes (lowered on the shared parent,
        never raised: another provider may have set a tighter cap)."""
        parent = self._parents.get("pids")
        if parent is None:
            return
        with contextlib.suppress(OSError, ValueError):
            current = (parent / "pids.max").read_text().strip()
            if current == "max" or int(current) > self.all_pids:
                (parent / "pids.max").write_text(str(self.all_pids))
            else:
                self.all_pids = int(current)

    # --- the memory budget of all sandboxes together ----------------------------------------------

    def memory_budget(self) -> MemoryBudget | None:
        """What all sandboxes together may be given now (None without a memory controller)."""
        parent = self._parents.get("memory")
        if parent is None or self.version is None:
            return None
        files = _MEMORY_FILES[self.version]
        sandboxes = _working_set(parent, files)
        hierarchy = self._root / "memory" if self.version == "v1" else self._root
        levels = [parent.parent, *[p for p in parent.parent.parents if p.is_relative_to(hierarchy)]]
        total, available = _meminfo()
        tightest = (available + sandboxes, total, "the machine")
        for level in levels:
            limit = _read_int(level / files.limit)
            if limit is None or limit >= _UNLIMITED:
                continue
            headroom = limit - max(0, _working_set(level, files) - sandboxes)
            if headroom < tightest[0]:
                tightest = (headroom, limit, str(level))
        headroom, limit, where = tightest
        reserve = max(MEMORY_RESERVE[0], limit // MEMORY_RESERVE[1])
        return MemoryBudget(max(0, headroom - reserve), headroom, reserve, limit, where)

    def _admit(self, sandbox_id: str, limits: Limits) -> None:
        """Refuse a sandbox whose memory limit the budget cannot give now (beyond what live sandboxes
        use); cap the shared parent at the budget, so the kernel holds all sandboxes together to it."""
        budget = self.memory_budget()
        if budget is None:
            return
        parent = self._parents["memory"]
        files = _MEMORY_FILES[self.version or "v1"]
        used = _working_set(parent, files)
        if limits.memory_bytes is not None and used + limits.memory_bytes > budget.total:
            raise SandboxLimitError(
                f"LocalProvider: sandbox {sandbox_id!r} asks for {limits.memory_bytes // _MiB} MiB of memory, but "
                f"the memory budget is {budget.describe()} and live sandboxes use {used // _MiB} MiB of it; close "
                "some, ask for less (memory_mib), or run where the trainer's cgroup allows more"
            )
        if budget.total > used:  # the kernel enforces the budget for all together
            with contextlib.suppress(OSError):
                _write(parent / files.limit, str(budget.total))
            if self.version == "v1":
                with contextlib.suppress(OSError):
                    _write(parent / "memory.kmem.tcp.limit_in_bytes", str(budget.total))

    # --- one sandbox's groups --------------------------------------------------------------------

    def create(self, sandbox_id: str, limits: Limits) -> list[Path]:
        """Make the sandbox's groups with its limits (admitted against the memory budget, one create at
        a time on this host's shared parent); returns their directories."""
        memory_parent = self._parents.get("memory")
        if memory_parent is None:
            return self._make(sandbox_id, limits)
        with self._lock:
            try:
                lock_fd = os.open(memory_parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                raise SandboxLimitError(f"cannot open the sandboxes' memory cgroup {memory_parent}: {exc}") from exc
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # other processes sharing this parent admit one at a time
                self._admit(sandbox_id, limits)
                return self._make(sandbox_id, limits)
            finally:
                os.close(lock_fd)

    def _make(self, sandbox_id: str, limits: Limits) -> list[Path]:
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
                if controller.write is not None and _limit_of(controller.resource, limits) is not None:
                    controller.write(group, limits)
        except OSError as exc:
            self.remove(list(groups))
            raise SandboxLimitError(f"cannot set up the cgroups of sandbox {sandbox_id!r}: {exc}") from exc
        return list(groups)

    def join_files(self, groups: Sequence[Path]) -> tuple[Path, ...]:
        """The files a single-threaded process joins ``groups`` by, writing ``0`` (itself): ``tasks`` on
        v1, which skips the kernel's global lock (and its RCU grace period) that ``cgroup.procs`` takes."""
        return tuple(group / ("tasks" if self.version == "v1" else "cgroup.procs") for group in groups)

    def groups_of(self, sandbox_id: str) -> list[Path]:
        """The existing groups of sandbox ``sandbox_id`` (derived from its id, never taken from a record)."""
        return [group for group in dict.fromkeys(p / sandbox_id for p in self._parents.values()) if group.is_dir()]

    def _freezer(self, groups: Sequence[Path]) -> tuple[Path, str, str, str] | None:
        """The group that freezes the sandbox of ``groups``, its control file, and its frozen and thawed words."""
        if self.version == "v2":
            return (groups[0], "cgroup.freeze", "1", "0") if groups else None
        parent = self._parents.get("freezer")
        group = next((g for g in groups if g.parent == parent), None)
        return None if group is None else (group, "freezer.state", "FROZEN", "THAWED")

    @contextlib.contextmanager
    def frozen(self, groups: Sequence[Path]) -> Iterator[bool]:
        """Freeze every process of the sandbox whose groups are ``groups`` (none runs until the block
        ends; what was in a system call finishes it first); yields whether they were frozen (False:
        no freezer here, or not frozen within ``_FREEZE_S``). They are thawed on the way out."""
        freezer = self._freezer(groups)
        try:
            if freezer is not None:
                _write(freezer[0] / freezer[1], freezer[2])
        except OSError:
            freezer = None
        try:
            yield freezer is not None and self._wait_frozen(freezer[0])
        finally:
            self.thaw(groups)

    def thaw(self, groups: Sequence[Path]) -> None:
        """Let the sandbox of ``groups`` run again (frozen by a snapshot, maybe by a process since killed)."""
        freezer = self._freezer(groups)
        if freezer is not None:
            with contextlib.suppress(OSError):  # a group removed meanwhile has nothing left to thaw
                _write(freezer[0] / freezer[1], freezer[3])

    def _wait_frozen(self, group: Path) -> bool:
        deadline = time.monotonic() + _FREEZE_S
        while True:
            try:
                if self.version == "v2":
                    done = "frozen 1" in (group / "cgroup.events").read_text().splitlines()
                else:
                    done = (group / "freezer.state").read_text().strip() == "FROZEN"
            except OSError:
                return False
            if done or time.monotonic() > deadline:
                return done
            time.sleep(0.0002)

    @staticmethod
    def commands_running(groups: Sequence[Path]) -> bool:
        """Whether a command (or something it started) is alive in the sandbox of ``groups``: a process
        three PID namespaces deep (ours, the sandbox's, its command's) that is not its command's init.
        The starter, bwrap and idle command inits are not commands."""
        for pid in _read_procs(groups[0]) if groups else []:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:  # gone meanwhile
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:"):
                    levels = line.split()[1:]
                    if len(levels) >= 3 and levels[-1] != "1":
                        return True
        return False

    @staticmethod
    def kill(groups: list[Path]) -> None:
        """SIGKILL every process in ``groups``, repeating until none is left (forks race the reads).

        Each is signalled and waited for through a pidfd: no pid is signalled after it was reused, and
        the wait ends the moment the last one exits (killed processes mostly go within a millisecond)."""
        for group in groups:
            with contextlib.suppress(OSError):
                (group / "cgroup.kill").write_text("1")
            with contextlib.suppress(OSError):  # v1: a frozen process takes no signal (its snapshot's maker died)
                (group / "freezer.state").write_text("THAWED")
        for _ in range(100):
            pids = {int(pid) for group in groups for pid in _read_procs(group)}
            if not pids:
                return
            pidfds = []
            try:
                for pid in pids:
                    try:
                        pidfds.append(os.pidfd_open(pid))
                    except ProcessLookupError:
                        continue
                    except OSError:  # out of descriptors, say: by pid, then
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, signal.SIGKILL)
                        continue
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        signal.pidfd_send_signal(pidfds[-1], signal.SIGKILL)
                if pidfds:
                    _wait_exits(pidfds, _KILL_ROUND_S)
                else:  # none could be waited for (gone already, or by pid): a short pause before the next reading
                    time.sleep(0.0005)
            finally:
                for pidfd in pidfds:
                    os.close(pidfd)

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


def _meminfo() -> tuple[int, int]:
    """The machine's MemTotal and MemAvailable, in bytes."""
    values = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, value = line.split(":", 1)
            values[name] = int(value.split()[0]) * 1024
    total = values.get("MemTotal", 0)
    return total, values.get("MemAvailable", total)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _working_set(group: Path, files: _Files) -> int:
    """What ``group`` uses, reclaimable file cache left out (as the kubelet counts it)."""
    usage = _read_int(group / files.usage) or 0
    inactive = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == files.inactive:
                inactive = int(value)
                break
    return max(0, usage - inactive)


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 0


def _wait_exits(pidfds: list[int], timeout_s: float) -> None:
    """Wait until every process of ``pidfds`` has exited, or until ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    for pidfd in pidfds:
        poller.register(pidfd, select.POLLIN)
    left = len(pidfds)
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        events = poller.poll(remaining * 1000)
        for pidfd, _mask in events:
            poller.unregister(pidfd)
        left -= len(events)


def _read_procs(group: Path) -> list[str]:
    try:
        return (group / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _limit_of(resource: str, limits: Limits) -> float | None:
    return {"memory": limits.memory_bytes, "pids": limits.pids, "cpu": limits.cpu}[resource]
