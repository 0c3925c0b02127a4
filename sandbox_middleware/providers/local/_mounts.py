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
from pathlib import Path

from .._common._limits import entry_bound
from ._bwrap import HOST_ENV

__all__ = ["bind_nosuid", "is_mount_point", "mount_overlay", "mount_tmpfs", "probe_tmpfs", "unmount"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MNT_DETACH = 2, 4, 32, 4096, 2
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


def _userns_mapping(uid: int) -> int:
    """A descriptor of a user namespace mapping uid and gid 0 (root's, this process's) to ``uid``, nothing else:
    made by a short-lived ``unshare --user`` (this process has threads: it cannot unshare itself)."""
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
        for name, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {uid} 1")):
            with open(f"/proc/{child.pid}/{name}", "w") as file:
                file.write(text)
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.kill()
        child.wait()


def _mount_idmapped(source: Path, target: Path, uid: int) -> None:
    """Mount ``source`` at ``target`` read-only (nosuid, nodev), every file of root's (ours) seen as ``uid``'s."""
    flags = _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
    userns = _userns_mapping(uid)
    try:
        attr = struct.pack("=QQQQ", flags, 0, 0, userns)  # struct mount_attr
        tree = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
        _check(tree, "open_tree", source)
        try:
            setattr_ = _libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, attr, len(attr))
            _check(setattr_, "mount_setattr", source)
            move = _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH)
            _check(move, "move_mount", target)
        finally:
            os.close(tree)
    finally:
        os.close(userns)


def mount_overlay(lower: Path, outer: Path, uid: int | None) -> None:
    """Mount a copy-on-write view of the tree ``lower`` at ``outer/box`` (nosuid, nodev): reads come from
    ``lower``, which is never written, and writes go to ``outer/upper`` (``outer``'s filesystem: the
    sandbox's own tmpfs). With ``uid``, the lower tree (this process's files) is seen through an idmapped
    mount at ``outer/lower`` as ``uid``'s, so the sandbox owns every file it starts with."""
    if uid is not None:
        _mount_idmapped(lower, outer / "lower", uid)
        lower = outer / "lower"
    options = f"lowerdir={lower},upperdir={outer / 'upper'},workdir={outer / 'work'}".encode()
    _mount(b"overlay", outer / "box", b"overlay", _MS_NOSUID | _MS_NODEV, options)


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
            mount_tmpfs(Path(where), 1 << 20)
        except OSError:
            return False
        unmount(Path(where))
        return True
