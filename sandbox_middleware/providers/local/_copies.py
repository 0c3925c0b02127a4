"""LocalProvider's copies of a sandbox's files: a snapshot's ``tree/`` (``_snapshots.take``), or a fork's
files where this process may not mount (``_layers.fill``). By descriptor, following no symlink (links
are kept as links), directories, regular files and symlinks only, each entry taken from a ``Budget``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence

from ..._errors import SandboxSnapshotError
from .._common._limits import Budget

__all__ = ["DIRECTORY", "MAX_DEPTH", "copy_names", "too_deep"]

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 256  # directories held open at once while copying or counting: a deeper tree is refused
_CHUNK = 1 << 24


def too_deep() -> SandboxSnapshotError:
    return SandboxSnapshotError(
        f"the files to snapshot nest more than {MAX_DEPTH} directories deep; snapshot a shallower tree"
    )


def _copy_file(source: int, target: int, name: str, budget: Budget) -> None:
    """Copy regular file ``name`` of directory ``source`` into ``target`` (mode and times kept, set-id bits
    dropped), its bytes taken from ``budget``; nothing when it is not a regular file any more (swapped
    meanwhile: not kept)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=source)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES):
            return
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=target)
        try:
            while sent := os.sendfile(out, fd, None, _CHUNK):
                budget.took(sent)
            os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o1777)
            os.utime(out, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def copy_names(source: int, target: int, names: Sequence[str], budget: Budget) -> None:
    """Copy the entries ``names`` of directory ``source`` into directory ``target`` (descriptors, kept
    open), whole trees, following no symlink (a link is copied as a link); directories, regular files and
    symlinks only, each taken from ``budget`` (past it, ``SandboxSnapshotError``)."""
    # Per directory being copied: its descriptor, its copy's, the names left, its name and stat (its parent's).
    stack: list[tuple[int, int, Iterator[str], str, os.stat_result | None]] = []
    stack.append((os.dup(source), os.dup(target), iter(names), "", None))
    try:
        while stack:
            src, dst, pending, _, _ = stack[-1]
            name = next(pending, None)
            if name is None:
                _, _, _, own, info = stack.pop()
                os.close(src)
                os.close(dst)
                if info is not None:  # its mode last: a directory without write permission is still filled
                    os.chmod(own, stat.S_IMODE(info.st_mode) & 0o1777, dir_fd=stack[-1][1], follow_symlinks=False)
                    os.utime(own, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=stack[-1][1], follow_symlinks=False)
                continue
            try:
                info = os.stat(name, dir_fd=src, follow_symlinks=False)
                budget.entry()
                if stat.S_ISLNK(info.st_mode):
                    os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
                    os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
                elif stat.S_ISREG(info.st_mode):
                    _copy_file(src, dst, name, budget)
                elif stat.S_ISDIR(info.st_mode):
                    if len(stack) > MAX_DEPTH:
                        raise too_deep()
                    child = os.open(name, DIRECTORY, dir_fd=src)
                    try:
                        os.mkdir(name, 0o700, dir_fd=dst)
                        copy = os.open(name, DIRECTORY, dir_fd=dst)
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, copy, iter(os.listdir(child)), name, info))
            except OSError as exc:  # removed or swapped meanwhile (the sandbox runs): as of now, not there
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
    finally:
        for src, dst, _, _, _ in stack:
            os.close(src)
            os.close(dst)
