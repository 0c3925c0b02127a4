"""The limits of one sandbox: the provider's defaults overridden by ``spec.resources``, and their ranges.

How each is enforced is the provider's own (LocalProvider: cgroups, rlimits, a bounded tmpfs, its
``mechanisms``; DockerProvider: the container's HostConfig). A limit the chosen mechanism cannot
enforce is refused with ``SandboxLimitError`` when asked for explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..._bounds import POSITIVE, Bound
from ..._errors import SandboxArgumentError, SandboxSnapshotError
from ._arguments import positive_number

__all__ = ["LIMIT_BOUNDS", "Budget", "Limits", "checked_limit", "entry_bound", "file_max"]

_MiB = 1 << 20
_GiB = 1 << 30


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
            and not any(hasattr(resources, name) for name in LIMIT_BOUNDS)
        ):
            raise SandboxArgumentError(
                f"spec.resources must be a mapping or an object with {', '.join(LIMIT_BOUNDS)}, not "
                f"{type(resources).__name__}"
            )
        values = dict(defaults)
        explicit = set()
        for name in LIMIT_BOUNDS:
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


# Each limit's range, the provider's defaults and ``spec.resources`` alike (None: unlimited). The
# largest value each takes is far above any machine, far below where the kernel would wrap.
LIMIT_BOUNDS: dict[str, Bound] = {
    "memory_mib": POSITIVE.at_most(2**24).or_none(),
    "pids": Bound(0, strict=True, whole=True, high=2**22, optional=True),
    "cpu": POSITIVE.at_most(4096).or_none(),
    "disk_gib": POSITIVE.at_most(2**14).or_none(),
}


def checked_limit(name: str, value: object, what: str) -> float | None:
    """A limit's value checked against its range (``pids`` must be a whole number)."""
    LIMIT_BOUNDS[name].check(value, what)
    return None if value is None else float(cast("float", value))  # checked: a number


def file_max() -> int:
    """The host's open-file table size (``fs.file-max``)."""
    try:
        return int(Path("/proc/sys/fs/file-max").read_text())
    except (OSError, ValueError):
        return 1 << 20


def entry_bound(size: int) -> int:
    """The entries (inodes) a sandbox's writable space of ``size`` bytes holds: its tmpfs's
    ``nr_inodes`` (``LocalProvider``), and what a snapshot of it may carry (both providers: an empty
    file or directory takes no room in a tmpfs, but an inode and a block where a snapshot is kept)."""
    return max(65_536, size // 16_384)


class Budget:
    """What a snapshot may still take, copied, counted or archived: bytes of regular files and entries
    (files, links, directories); None: no bound. A snapshot's is the size of the writable space it is
    taken of (``limits`` names the options that set it) and that space's inode bound
    (``entry_bound``), so a copy taken while the sandbox runs cannot carry more than its space ever
    held at once, however the sandbox renames and recreates entries under the copier (each entry met
    counts once), and a snapshot without a copy holds no more than one copy would."""

    def __init__(self, size: int | None, limits: str = "disk_gib") -> None:
        self.size = size
        self.limits = limits
        self.most = None if size is None else entry_bound(size)
        self.entries = 0
        self.copied = 0

    def entry(self, count: int = 1) -> None:
        self.entries += count
        if self.most is not None and self.entries > self.most:
            raise SandboxSnapshotError(
                f"the files to snapshot are more than {self.most} entries, more than the sandbox's disk "
                f"({self.limits}) holds at once; nothing was kept: snapshot fewer paths"
            )

    def took(self, size: int) -> None:
        self.copied += size
        if self.size is not None and self.copied > self.size:
            raise SandboxSnapshotError(
                f"the files to snapshot hold more than {self.size} bytes, the sandbox's disk limit ({self.limits}; a "
                f"sparse file counts whole); nothing was kept: snapshot fewer paths, or make the sandbox with a "
                f"larger {self.limits}"
            )
