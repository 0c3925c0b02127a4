"""LocalProvider's resource limits: cgroups (v1 or v2) or rlimits, a bounded tmpfs, and TTL expiry.

Each mechanism is chosen once per provider from what the machine allows, and reported. A limit the
chosen mechanism cannot enforce is refused with ``SandboxLimitError`` when asked for explicitly.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import logging
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import SandboxArgumentError, SandboxLimitError

__all__ = ["CgroupBackend", "Limits", "Watchdog", "mount_tmpfs", "probe_tmpfs", "unmount"]

logger = logging.getLogger("sandbox_middleware")

_MiB = 1 << 20
_GiB = 1 << 30
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PARENT = "sandbox-middleware"


@dataclass(frozen=True)
class Limits:
    """The limits of one sandbox; None means unlimited."""

    memory_bytes: int | None
    pids: int | None
    cpu: float | None
    disk_bytes: int | None
    explicit: frozenset[str] = frozenset()

    @classmethod
    def resolve(cls, defaults: Mapping[str, float | None], resources: Any) -> Limits:
        """Provider defaults overridden by ``spec.resources`` (a mapping or an object with NeMo Gym's fields)."""
        if (
            resources is not None
            and not isinstance(resources, Mapping)
            and not any(hasattr(resources, name) for name in _MAXIMA)
        ):
            raise SandboxArgumentError(
                f"spec.resources must be a mapping or an object with {', '.join(_MAXIMA)}, not "
                f"{type(resources).__name__}"
            )
        values = dict(defaults)
        explicit = set()
        for name in _MAXIMA:
            given = resources.get(name) if isinstance(resources, Mapping) else getattr(resources, name, None)
            if given is not None:
                values[name] = given
                explicit.add(name)
        for name, value in values.items():
            checked_limit(name, value, f"resources.{name}" if name in explicit else name)
        memory, disk, pids, cpu = values["memory_mib"], values["disk_gib"], values["pids"], values["cpu"]
        return cls(
            memory_bytes=None if memory is None else int(memory * _MiB),
            pids=None if pids is None else int(pids),
            cpu=None if cpu is None else float(cpu),
            disk_bytes=None if disk is None else int(disk * _GiB),
            explicit=frozenset(explicit),
        )

    def record(self) -> list[float | None]:
        return [self.memory_bytes, self.pids, self.cpu, self.disk_bytes]

    @classmethod
    def from_record(cls, values: Any) -> Limits:
        """The limits from ``record()``, each checked again (a record is read from disk)."""
        values = list(values)
        if len(values) != 4:
            raise SandboxArgumentError("a recorded sandbox's limits must be four values")
        memory, pids, cpu, disk = (positive_number(value, "recorded limit") for value in values)
        return cls(
            memory_bytes=None if memory is None else int(memory),
            pids=None if pids is None else int(pids),
            cpu=cpu,
            disk_bytes=None if disk is None else int(disk),
        )


# The largest value each limit takes: far above any machine, far below where the kernel would wrap.
_MAXIMA: dict[str, float] = {"cpu": 4096, "memory_mib": 2**24, "disk_gib": 2**14, "pids": 2**22}


def checked_limit(name: str, value: object, what: str) -> float | None:
    """A limit's value checked against its range (``pids`` must be a whole number)."""
    number = positive_number(value, what, maximum=_MAXIMA[name])
    if name == "pids" and number is not None and not number.is_integer():
        raise SandboxArgumentError(f"{what} must be a whole number of processes, not {value!r}")
    return number


def as_float(value: object, what: str) -> float:
    """An int or float as a float (an int too large for one is infinity); else ``SandboxArgumentError``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SandboxArgumentError(f"{what} must be a number, not {type(value).__name__} ({value!r:.80})")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def positive_number(value: object, what: str, *, allow_none: bool = True, maximum: float = 2.0**53) -> float | None:
    """``value`` if it is a finite number in (0, maximum] (or None where allowed), else ``SandboxArgumentError``."""
    if value is None and allow_none:
        return None
    number = as_float(value, what)
    if not math.isfinite(number) or not 0 < number <= maximum:
        raise SandboxArgumentError(f"{what} must be a finite number above 0 and at most {maximum:g}, not {value!r:.80}")
    return number


# --- cgroups -------------------------------------------------------------------------------------


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


# --- the bounded tmpfs ---------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MNT_DETACH = 2, 4, 32, 4096, 2


def _mount(source: bytes | None, target: Path, fstype: bytes | None, flags: int, options: bytes | None) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def mount_tmpfs(target: Path, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes at ``target`` (nosuid, nodev, root's): the sandbox's writable space."""
    inodes = max(65_536, size // 16_384)
    _mount(b"tmpfs", target, b"tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},nr_inodes={inodes},mode=0711".encode())


def bind_nosuid(target: Path) -> None:
    """Make ``target`` a mount of its own with nosuid and nodev (no set-uid file planted there works)."""
    _mount(os.fsencode(target), target, None, _MS_BIND, None)
    try:
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV, None)
    except OSError:
        unmount(target)
        raise


def unmount(target: Path) -> None:
    """Detach the tmpfs at ``target`` (lazily, so a straggling open file cannot keep it)."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def is_mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point (``os.path.ismount`` misses a bind mount of a directory onto itself)."""
    target = os.fsencode(path)
    try:
        with open("/proc/self/mountinfo", "rb") as mountinfo:
            for line in mountinfo:
                point = line.split(b" ", 5)[4]
                if point.replace(b"\\040", b" ").replace(b"\\011", b"\t").replace(b"\\012", b"\n") == target:
                    return True
    except (OSError, IndexError):
        return os.path.ismount(path)
    return False


def probe_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root, or CAP_SYS_ADMIN)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-middleware-probe-") as where:
        try:
            mount_tmpfs(Path(where), _MiB)
        except OSError:
            return False
        unmount(Path(where))
        return True


# --- TTL expiry ----------------------------------------------------------------------------------


class Watchdog:
    """One daemon thread per provider that calls ``expire(sandbox_id)`` when a sandbox's TTL runs out.

    It runs only while some sandbox has a deadline and needs no event loop, so a TTL holds even when
    nothing calls the provider.
    """

    def __init__(self, expire: Callable[[str], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, str]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, deadline: float, sandbox_id: str) -> None:
        with self._wake:
            heapq.heappush(self._heap, (deadline, sandbox_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sandbox-ttl", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self._heap:
                        return
                    deadline, sandbox_id = self._heap[0]
                    wait = deadline - time.monotonic()
                    if wait > 0:
                        self._wake.wait(min(wait, 3600.0))
                        continue
                    heapq.heappop(self._heap)
                try:
                    self._expire(sandbox_id)
                except Exception:  # a failed kill must not end the watchdog
                    logger.exception("sandbox TTL: could not end %s", sandbox_id)
        finally:
            with self._wake:
                self._thread = None
                if self._heap:  # something raced in after the last check: keep watching
                    self._thread = threading.Thread(target=self._run, name="sandbox-ttl", daemon=True)
                    self._thread.start()
