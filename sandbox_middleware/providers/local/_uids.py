"""Host uids of LocalProvider sandboxes (as root): each live sandbox holds its own, on one host, across processes.

A uid is taken by a lease: the file ``/run/llm-sandbox-middleware/uids/<uid>``, locked (``flock``)
for as long as its sandbox lives in this process. Taking one draws a uid at random in the range
and, if its lease is held, tries the next ones; a lease is free when nobody holds its lock (its
process closed the sandbox, or died: the kernel drops the lock then). Released leases are unlinked
while still locked, and a taker checks that the file it locked is still the one at that path, so
two processes never both think they hold one uid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path

from ..._errors import SandboxCreateError

__all__ = ["UID_BASE", "UID_COUNT", "UidLease", "draw", "lease_uid"]

# Far above any account or container range in common use; below 2**31: bwrap writes its uid map as a signed int.
UID_BASE, UID_COUNT = 1_500_000_000, 1 << 24
LEASES = Path("/run/llm-sandbox-middleware/uids")
_PROBES = 4096  # leases tried after one draw before giving up (each a failed non-blocking flock)


def draw() -> int:
    """The uid to try first (random in the range; tests force it to repeat)."""
    return UID_BASE + secrets.randbelow(UID_COUNT)


class UidLease:
    """A held lease of one uid: ``release()`` frees it (unlinked while locked, then closed)."""

    def __init__(self, uid: int, fd: int, path: Path) -> None:
        self.uid, self._fd, self._path = uid, fd, path

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = -1


def _leases_dir(directory: Path) -> int:
    """The lease directory's descriptor: made if missing; root's (ours), mode 0700, a real directory."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(directory.parent, mode=0o755, exist_ok=True)
        os.mkdir(directory, 0o700)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SandboxCreateError(
            f"LocalProvider: the uid lease directory {directory} is not this user's private directory "
            f"(uid {info.st_uid}, mode {oct(stat.S_IMODE(info.st_mode))}); remove it"
        )
    return fd


def _try(dir_fd: int, directory: Path, uid: int) -> UidLease | None:
    name = str(uid)
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    try:
        held, current = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:  # released (unlinked) by its holder after we opened it
        os.close(fd)
        return None
    if (held.st_dev, held.st_ino) != (current.st_dev, current.st_ino):
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return UidLease(uid, fd, directory / name)


def lease_uid(directory: Path = LEASES) -> UidLease:
    """A uid of the range that no live sandbox on this host holds, leased to the caller."""
    try:
        dir_fd = _leases_dir(directory)
    except OSError as exc:
        raise SandboxCreateError(f"LocalProvider: cannot use the uid lease directory {directory}: {exc}") from exc
    try:
        start = draw() - UID_BASE
        for step in range(_PROBES):
            uid = UID_BASE + (start + step) % UID_COUNT
            lease = _try(dir_fd, directory, uid)
            if lease is not None:
                return lease
    except OSError as exc:
        raise SandboxCreateError(f"LocalProvider: cannot lease a sandbox uid in {directory}: {exc}") from exc
    finally:
        os.close(dir_fd)
    raise SandboxCreateError(
        f"LocalProvider: {_PROBES} sandbox uids in a row are held by live sandboxes ({directory}); close some"
    )
