"""A LocalProvider sandbox on disk: its directory in base_dir, its private record, and its removal.

Each sandbox is a directory ``base_dir/<sandbox id>-<random>`` (a bounded tmpfs where the provider
may mount one) holding ``box/`` (the sandbox's files, seen at its view root), ``tmp/``, ``shm/``,
``etc/`` (read-only) and ``meta.json``, the record another process needs to list, connect to or
close it (out of the sandbox's view). ``Box`` is what a provider keeps of each sandbox it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..._errors import SandboxArgumentError, SandboxError
from ..._owner import Owner
from .._common._limits import Limits
from .._common._uids import UidLease
from ._bwrap import OWN_ETC
from ._cgroups import CgroupBackend
from ._launch import Launch
from ._mounts import is_mount_point, mounts_under, unmount
from ._process import kill_group
from ._supervisor import CommandStarter
from ._transfers import open_directory

__all__ = [
    "MAKER",
    "RECORD",
    "SANDBOX_ID",
    "SPARE_RECORD",
    "Box",
    "check_reachable",
    "directories_of",
    "drop_maker",
    "intact",
    "is_real_directory",
    "kill_box",
    "lay_out",
    "makers",
    "prepare_base",
    "read_record",
    "remove_box",
    "scan",
    "teardown",
    "write_maker",
    "write_private",
]

SANDBOX_ID = re.compile(r"local-[0-9a-f]{12}")
RECORD = "meta.json"  # beside box/, out of the sandbox's view
PINNED = "pinned"  # in a sandbox's directory: a snapshot holds its tmpfs (``_layers.rotate``)
VIEW = "view.json"  # beside box/: how its files are made, once they are layers (``_layers.View``)
ROTATING = "rotating.json"  # beside box/ (empty) while a snapshot freezes its files: left, its maker was killed
SPARE_RECORD = "spare.json"  # instead of RECORD while the sandbox is a spare (``_spares.py``): its maker
# base_dir/<sandbox id>.maker: the process making (or removing) that sandbox (``Owner`` metadata), written
# before anything else of it and removed once it has a record (or is gone), so a maker killed in between
# leaves a trail: the next provider on base_dir, or reap, removes what it left once it is found dead.
MAKER = ".maker"
_MAKER: tuple[int, bytes] | None = None  # this process's pid and maker record


@dataclass
class Box:
    """What a provider keeps of one sandbox it holds: its directory, its view, its limits and its state."""

    outer: Path  # the sandbox's own directory: a bounded tmpfs holding box/, tmp/ and etc/
    view_root: PurePosixPath  # the absolute workdir, or /workspace: where bwrap shows box/
    isolated: bool
    env: dict[str, str]
    cwd: tuple[str, ...]  # components below box/
    ports: tuple[int, ...]
    cgroups: list[Path]
    mounted: bool
    deadline: float | None  # time.monotonic() at which the TTL runs out
    limits: Limits
    metadata: dict[str, str]
    created: float  # time.time() at create
    launch: Launch  # how its commands start: rlimits, cgroups joined, PTY or not, host uid
    lease: UidLease | None = None  # the host-wide lease of its uid, held while it lives here
    snapshot: str | None = None  # the id of the snapshot its files started as (a fork's; ``_snapshots.py``)
    starter: CommandStarter | None = None  # under bwrap: what starts its commands (see _starter.py)
    groups: dict[int, int] = field(default_factory=dict)  # process group -> alive_ticks() when last seen alive
    expired: bool = False
    closed: bool = False  # close() has begun
    broken: bool = False  # a close could not remove everything

    @property
    def sandbox_id(self) -> str:
        return self.outer.name[:18]

    @property
    def uid(self) -> int | None:
        """The host uid its commands run as (None: this process's)."""
        return self.launch.uid

    def is_expired(self) -> bool:
        return self.expired or (self.deadline is not None and time.monotonic() >= self.deadline)

    @property
    def root(self) -> Path:
        return self.outer / "box"

    @property
    def roots(self) -> tuple[PurePosixPath, ...]:
        """The absolute paths that name the sandbox root: its view path, and (without isolation) its real one."""
        return (self.view_root,) if self.isolated else (self.view_root, PurePosixPath(self.root))

    @property
    def home(self) -> PurePosixPath:
        """Where commands find the sandbox root."""
        return self.view_root if self.isolated else PurePosixPath(self.root)

    def record(self) -> dict[str, Any]:
        """What another process needs to use this sandbox (kept in ``meta.json`` and in descriptors).

        Its cgroups and mount are not part of it: they are derived from the sandbox's id and
        directory, so a forged record can never point them at anything else.
        """
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        return {
            "view_root": str(self.view_root),
            "env": self.env,
            "cwd": list(self.cwd),
            "ports": list(self.ports),
            "expires_at": None if remaining is None else time.time() + remaining,
            "limits": self.limits.record(),
            "metadata": self.metadata,
            "created": self.created,
            "uid": self.uid,
            "snapshot": self.snapshot,
        }


def intact(box: Box) -> bool:
    return box.root.is_dir() and all(group.is_dir() for group in box.cgroups)


def lay_out(outer: Path, uid: int | None) -> None:
    """The sandbox's directory: box/ (its files), tmp/ and shm/ (its /tmp, /dev/shm), etc/ (read-only).

    ``outer`` and etc/ stay ours (root's), so nothing the sandbox's uid can do lands on a path this
    process writes by name; box/, tmp/ and shm/ are the sandbox's alone (0700, its uid).
    """
    os.chmod(outer, 0o711)  # reachable, not listable
    dir_fd = os.open(outer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in ("box", "tmp", "shm"):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            if uid is not None:
                os.chown(name, uid, uid, dir_fd=dir_fd, follow_symlinks=False)
        os.mkdir("etc", 0o755, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    for name, text in OWN_ETC.items():
        write_private(outer / "etc", name, text.encode(), mode=0o644)


def write_private(directory: Path, name: str, data: bytes, *, mode: int = 0o600) -> None:
    """Create ``directory/name`` afresh (never through a symlink, never an existing file) and write it."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def prepare_base(base: Path) -> None:
    """Make ``base`` (0711) or check it: ours, a real directory (not a symlink), writable by nobody
    else, since sandbox directories, their records and their mounts are made there. Checked on the
    directory opened without following a symlink, not by name."""
    try:
        base.mkdir(mode=0o711, parents=True, exist_ok=True)
    except OSError as exc:
        raise SandboxArgumentError(f"LocalProvider: cannot make base_dir {base}: {exc}") from exc
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxArgumentError(
            f"LocalProvider: base_dir {base} is not a real directory ({exc.strerror}: a symlink, planted there "
            "by another user, would send sandboxes elsewhere); remove it or choose another base_dir"
        ) from exc
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxArgumentError(
            f"LocalProvider: base_dir {base} must be a directory of this user (uid {os.geteuid()}) that no one "
            f"else can write to (it is uid {info.st_uid}, mode {oct(info.st_mode & 0o7777)}); others could plant "
            "or swap sandbox directories there. Leave base_dir unset for a private one in the temp directory"
        )


def check_reachable(path: Path) -> None:
    """bwrap runs as the sandbox's own uid and must reach ``path``: every parent needs o+x."""
    for directory in reversed(path.parents):
        try:
            info = directory.stat()
        except FileNotFoundError:
            return
        if not info.st_mode & 0o001:
            raise SandboxArgumentError(
                f"LocalProvider: {path} (base_dir or ro_paths) is out of reach of the sandboxes' unprivileged "
                f"uids: {directory} has mode {oct(info.st_mode & 0o777)} without search permission for others; "
                "choose a path whose parents all have o+x (the temp directory's do), or chmod o+x them"
            )


def read_record(outer: Path, uid: int, name: str = RECORD) -> dict[str, Any]:
    with open_directory(outer, (), outer.name) as dir_fd:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
            raise ValueError("not a record of ours")
        record = json.loads(file.read(1 << 20))
    if not isinstance(record, dict):
        raise ValueError("not a record")
    return record


def scan(base: Path, name: str = RECORD, ids: re.Pattern[str] = SANDBOX_ID) -> list[tuple[str, Path, dict[str, Any]]]:
    """The sandbox directories in base_dir with their records (``name``: ``SPARE_RECORD`` for the
    spares; with ``ids`` the snapshots', ``_snapshots.py``): ours only (this uid's, real directories, a
    regular 0600 record of ours), each id at most once."""
    found: dict[str, tuple[str, Path, dict[str, Any]] | None] = {}
    uid = os.geteuid()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            sandbox_id = entry.name[:18]
            if not (ids.fullmatch(sandbox_id) and entry.name[18:19] == "-"):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                    continue
                record = read_record(Path(entry.path), uid, name)
            except (OSError, SandboxError, ValueError, RecursionError):
                continue  # being created or removed, or not ours
            # The same id twice is a planted copy (or a bug): trust neither.
            found[sandbox_id] = None if sandbox_id in found else (sandbox_id, Path(entry.path), record)
    return [item for item in found.values() if item is not None]


def write_maker(base: Path, sandbox_id: str) -> None:
    """Name this process (its ``Owner`` metadata) as the maker of ``sandbox_id``, unless a maker is
    named already (a sandbox this process closes was made here, or by a dead process)."""
    global _MAKER
    if _MAKER is None or _MAKER[0] != os.getpid():  # once per process (a fork is another)
        _MAKER = (os.getpid(), json.dumps(Owner.current().metadata()).encode())
    with contextlib.suppress(FileExistsError):
        write_private(base, sandbox_id + MAKER, _MAKER[1])


def drop_maker(outer: Path) -> None:
    """The sandbox at ``outer`` has its record, or is gone: its maker file goes."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # never written (base_dir is no directory)
        os.unlink(outer.parent / (outer.name[:18] + MAKER))


def makers(base: Path, ids: re.Pattern[str] = SANDBOX_ID) -> list[tuple[str, dict[str, Any]]]:
    """The maker files in base_dir (ours only: regular 0600 files of this uid), with the sandbox id (or
    with ``ids``, the snapshot id) each names."""
    found = []
    uid = os.geteuid()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            sandbox_id = entry.name.removesuffix(MAKER)
            if sandbox_id == entry.name or not ids.fullmatch(sandbox_id):
                continue
            try:
                found.append((sandbox_id, read_record(base, uid, entry.name)))
            except (OSError, SandboxError, ValueError, RecursionError):
                continue  # removed meanwhile, or not ours
    return found


def directories_of(base: Path, sandbox_id: str) -> list[Path]:
    """The directories of sandbox ``sandbox_id`` in base_dir (real ones, of this uid)."""
    found = []
    uid = os.geteuid()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            if entry.name.startswith(sandbox_id + "-"):
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
                        found.append(Path(entry.path))
    return found


def is_real_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def kill_box(box: Box) -> None:
    """Kill every process of the sandbox: through its cgroups where it has them (no pid is ever
    signalled by a number that could have been reused), else its still-running process groups (only while
    one of a group's processes is as old as the group was last seen alive, ``_process.py``). A
    starter's death alone ends every process of its sandbox (bwrap's init takes them with it)."""
    if box.starter is not None:
        box.starter.kill()
    if box.cgroups:
        CgroupBackend.kill(box.cgroups)
    else:
        for group, alive_at in list(box.groups.items()):
            kill_group(group, alive_at)


def teardown(box: Box, base: Path) -> list[str]:
    """End the sandbox's starter and processes, then remove it (only ever inside ``base``, where its
    provider made it or ``connect`` checked it lies), this process named as its remover meanwhile;
    returns what could not be removed."""
    if box.starter is not None:
        box.starter.close()
    kill_box(box)
    if not box.outer.is_relative_to(base):
        return [f"{box.outer} (outside base_dir {base}; not touched)"]
    if os.path.lexists(box.outer / PINNED):  # its tmpfs outlives it in a snapshot: its /tmp and /dev/shm go now
        for name in ("tmp", "shm"):
            remove_tree(box.outer / name)
    try:
        with contextlib.suppress(OSError):  # base_dir gone, say: nothing of it is left to remove
            write_maker(base, box.sandbox_id)  # killed while removing it, the next sweep ends the work
        return remove_box(box.outer, box.mounted, box.cgroups)
    finally:
        if box.lease is not None:  # its processes are dead: the uid is free for another sandbox
            box.lease.release()


def remove_box(outer: Path, mounted: bool, cgroups: list[Path]) -> list[str]:
    """Kill, unmount and delete a sandbox's directory and cgroups; returns what could not be removed."""
    CgroupBackend.kill(cgroups)
    failed = []
    if mounted and is_mount_point(outer):  # another process may have closed it already
        try:
            unmount(outer)  # frees the tmpfs (and its memory) at once
        except OSError as exc:
            failed.append(f"{outer} (unmount: {exc.strerror})")
    elif not mounted:  # a snapshot's directory: its layers (read-only mounts) first; none in a sandbox's
        for point in mounts_under(outer):
            try:
                unmount(point)
            except OSError as exc:
                failed.append(f"{point} (unmount: {exc.strerror})")
    if os.path.lexists(outer):
        failed += remove_tree(outer)
    failed = (CgroupBackend.remove(cgroups) if cgroups else []) + failed
    if not failed:
        drop_maker(outer)
    return failed


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPEN = 64  # directories held open at once while removing; deeper ones are moved up first


def remove_tree(top: Path) -> list[str]:
    """Delete ``top`` and everything in it, by descriptor, following no symlink, at any depth.

    No recursion and at most ``_MAX_OPEN`` descriptors: a directory deeper than that is renamed into
    ``top`` itself and removed from there, so a tree thousands deep is removed like a flat one.
    Returns what could not be removed (its processes must be dead: nothing races the walk).
    """
    failed: list[str] = []
    try:
        root = os.open(top, _DIR)
    except OSError as exc:
        return [f"{top} ({exc.strerror})"]
    # Per open directory: its descriptor, its name in its parent, the names left alone, what is left to visit.
    stack: list[tuple[int, str, set[str], Iterator[str]]] = [(root, "", set(), iter(os.listdir(root)))]
    moved = 0
    try:
        while stack:
            fd, _, skipped, pending = stack[-1]
            name = next(pending, None)
            if name is None:
                left = [entry for entry in os.listdir(fd) if entry not in skipped]  # moved in meanwhile
                if left:
                    stack[-1] = (fd, stack[-1][1], skipped, iter(left))
                    continue
                fd, name, _, _ = stack.pop()
                os.close(fd)
                if stack:
                    try:
                        os.rmdir(name, dir_fd=stack[-1][0])
                    except OSError as exc:
                        stack[-1][2].add(name)
                        failed.append(f"{top}/.../{name} ({exc.strerror})")
                continue
            if name in skipped:
                continue
            try:
                if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
                    continue
                with contextlib.suppress(OSError):  # not empty: go in
                    os.rmdir(name, dir_fd=fd)
                    continue
                if len(stack) >= _MAX_OPEN:
                    moved += 1
                    os.rename(name, f".deep-{moved}", src_dir_fd=fd, dst_dir_fd=root)
                    continue
                child = os.open(name, _DIR, dir_fd=fd)
                stack.append((child, name, set(), iter(os.listdir(child))))
            except OSError as exc:
                skipped.add(name)
                failed.append(f"{top}/.../{name} ({exc.strerror})")
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)
    if not failed:
        try:
            os.rmdir(top)
        except OSError as exc:
            failed.append(f"{top} ({exc.strerror})")
    return failed
