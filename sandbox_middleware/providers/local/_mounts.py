"""The mount syscalls of LocalProvider: each sandbox directory a bounded tmpfs (or a nosuid bind mount).

Only root (or CAP_SYS_ADMIN) may mount; ``probe_tmpfs`` tells once per provider whether it can.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

__all__ = ["bind_nosuid", "is_mount_point", "mount_tmpfs", "probe_tmpfs", "unmount"]

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
            mount_tmpfs(Path(where), 1 << 20)
        except OSError:
            return False
        unmount(Path(where))
        return True
