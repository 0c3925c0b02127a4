"""The mount syscalls of LocalProvider: each sandbox directory a bounded tmpfs (or a nosuid bind mount);
a fork's files an overlay on its snapshot (``mount_overlay``).

Only root (or CAP_SYS_ADMIN) may mount; ``probe_tmpfs`` tells once per provider whether it can.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .._common._limits import entry_bound
from ._bwrap import HOST_ENV

__all__ = [
    "bind_nosuid",
    "clone_readonly",
    "is_mount_point",
    "mount_overlay",
    "mount_tmpfs",
    "mounted_at",
    "mounts_under",
    "probe_tmpfs",
    "share",
    "unmount",
    "userns_mapping",
]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MNT_DETACH = 2, 4, 32, 4096, 2
_MS_PRIVATE, _MS_SHARED = 1 << 18, 1 << 20
# The new mount API (Linux 5.12+ for idmapped mounts; one syscall number on every architecture).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_EMPTY_PATH, _AT_FDCWD = 1, os.O_CLOEXEC, 0x1000, -100
_MOVE_MOUNT_F_EMPTY_PATH = 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_IDMAP = 1, 2, 4, 0x100000
_USERNS_TIMEOUT_S = 10.0


def _mount(source: bytes | None, target: Path, fstype: bytes | None, flags: int, options: bytes | None) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, flags, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def mount_tmpfs(target: Path, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes at ``target`` (nosuid, nodev, root's): the sandbox's writable space."""
    options = f"size={size},nr_inodes={entry_bound(size)},mode=0711".encode()
    _mount(b"tmpfs", target, b"tmpfs", _MS_NOSUID | _MS_NODEV, options)


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


def _check(result: int, what: str, target: Path) -> None:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", str(target))


def userns_mapping(owner: int, uid: int) -> int:
    """A descriptor of a user namespace mapping uid and gid ``owner`` to ``uid``, nothing else: made by a
    short-lived ``unshare --user`` (this process has threads: it cannot unshare itself)."""
    child = subprocess.Popen(
        ["unshare", "--user", "cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=HOST_ENV,  # what every host-side helper gets: no LD_PRELOAD of ours reaches it
    )
    try:
        ours = os.stat("/proc/self/ns/user").st_ino
        deadline = time.monotonic() + _USERNS_TIMEOUT_S
        while os.stat(f"/proc/{child.pid}/ns/user").st_ino == ours:
            if child.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"unshare --user did not make a user namespace (exit status {child.returncode})")
            time.sleep(0.0005)
        for name, text in (("uid_map", f"{owner} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{owner} {uid} 1")):
            with open(f"/proc/{child.pid}/{name}", "w") as file:
                file.write(text)
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.kill()
        child.wait()


def clone_readonly(source: Path, target: Path, userns: int | None = None) -> None:
    """Mount the tree at ``source`` (the mount there, or a directory of one) again at ``target``: read-only,
    nosuid, nodev and private (nothing mounted on ``source`` later shows at ``target``). With ``userns``
    (``userns_mapping``'s), idmapped through it."""
    flags = _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (0 if userns is None else _MOUNT_ATTR_IDMAP)
    attr = struct.pack("=QQQQ", flags, 0, _MS_PRIVATE, 0 if userns is None else userns)  # struct mount_attr
    tree = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    _check(tree, "open_tree", source)
    try:
        setattr_ = _libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, attr, len(attr))
        _check(setattr_, "mount_setattr", source)
        move = _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
        _check(move, "move_mount", target)
    finally:
        os.close(tree)


def share(target: Path) -> None:
    """Make directory ``target`` a shared mount of its own (nosuid, nodev): a sandbox's view of it (bwrap's
    bind, a slave) then shows what is mounted on it later, as a fork's or a snapshot's files are."""
    bind_nosuid(target)
    try:
        _mount(None, target, None, _MS_SHARED, None)
    except OSError:
        unmount(target)
        raise


def mount_overlay(lowers: Sequence[Path], upper: Path, work: Path, target: Path) -> None:
    """Mount a copy-on-write view at ``target`` (nosuid, nodev): reads from the read-only trees ``lowers``
    (the first on top), never written, and writes to ``upper`` (``work``: overlayfs's own, beside it)."""
    lowerdir = ":".join(str(lower) for lower in lowers)
    options = f"lowerdir={lowerdir},upperdir={upper},workdir={work}".encode()
    _mount(b"overlay", target, b"overlay", _MS_NOSUID | _MS_NODEV, options)


def _mount_points() -> Iterator[bytes]:
    """Every mount point of this process's mount namespace, in the order mounted (``/proc/self/mountinfo``)."""
    with open("/proc/self/mountinfo", "rb") as mountinfo:
        for line in mountinfo:
            yield line.split(b" ", 5)[4].replace(b"\\040", b" ").replace(b"\\011", b"\t").replace(b"\\012", b"\n")


def mounts_under(top: Path) -> list[Path]:
    """The mount points strictly below ``top``, the last mounted first (the order to unmount them in)."""
    prefix = os.fsencode(top).rstrip(b"/") + b"/"
    return [Path(os.fsdecode(point)) for point in _mount_points() if point.startswith(prefix)][::-1]


def mounted_at(path: Path) -> int:
    """How many mounts are stacked at ``path`` (0: it is no mount point)."""
    target = os.fsencode(path)
    return sum(point == target for point in _mount_points())


def is_mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point (``os.path.ismount`` misses a bind mount of a directory onto itself)."""
    try:
        return mounted_at(path) > 0
    except (OSError, IndexError):
        return os.path.ismount(path)


def probe_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (root, or CAP_SYS_ADMIN)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-middleware-probe-") as where:
        try:
            mount_tmpfs(Path(where), 1 << 20)
        except OSError:
            return False
        unmount(Path(where))
        return True
