"""LocalProvider's file transfers with a hostile sandbox: race-free, following no symlink.

A command in the sandbox may swap any path for a symlink at any moment, so no path is ever checked
and then opened again by name. Every transfer opens the sandbox root, then each component below it
with ``O_NOFOLLOW`` relative to the directory descriptor before it (``openat``): a symlink anywhere
on the way is refused, never followed. Sandbox paths are split into those components by
``_arguments.sandbox_parts``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..._errors import SandboxError, SandboxPathError, SandboxTransferLimitError

__all__ = [
    "check_directory",
    "download",
    "open_directory",
    "upload",
]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


@contextlib.contextmanager
def open_directory(
    root: Path, parts: Sequence[str], path: str, *, create: bool = False, owner: int | None = None
) -> Iterator[int]:
    """A descriptor of directory ``root/parts``, each component opened without following symlinks.

    With ``create``, missing directories are made, belonging to ``owner`` where given.
    """
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    if owner is not None:
                        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _path_error(exc, fd, path, name) from exc
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _path_error(exc: OSError, dir_fd: int, path: str, name: str) -> SandboxError:
    # With O_DIRECTORY | O_NOFOLLOW a symlink fails as ENOTDIR, like a file; lstat tells which (for the
    # message only: nothing is opened by name again).
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(dir_fd, name):
        return SandboxPathError(
            f"path {path!r} passes through a symlink ({name!r}); a symlink could lead outside the sandbox, "
            "so transfers never follow one: name the real file"
        )
    if exc.errno == errno.ENOENT:
        return SandboxError(f"path {path!r}: {name!r} does not exist in the sandbox")
    if exc.errno == errno.ENOTDIR:
        return SandboxError(f"path {path!r}: {name!r} is not a directory in the sandbox")
    return SandboxError(f"path {path!r}: cannot open {name!r}: {exc.strerror}")


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return True  # swapped again meanwhile: still not followed


def _open_file(dir_fd: int, name: str, path: str, flags: int) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SandboxPathError(
                f"path {path!r} is a symlink; a symlink could lead outside the sandbox, so transfers never "
                "follow one: name the real file"
            ) from exc
        if exc.errno in (errno.ENOENT, errno.EISDIR, errno.ENXIO):
            raise SandboxError(f"{path!r} is not a file in the sandbox") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SandboxError(f"{path!r} is not a file in the sandbox (a directory, FIFO, socket or device)")
    return fd


def _copy(source_fd: int, target_fd: int, limit: int | None) -> int:
    """Copy until end of file; more than ``limit`` bytes stops the copy and is reported as ``limit + 1``."""
    copied = 0
    while True:
        want = _CHUNK if limit is None else min(_CHUNK, limit + 1 - copied)
        if want <= 0:
            return copied
        data = os.read(source_fd, want)
        if not data:
            return copied
        view = memoryview(data)
        while view:
            view = view[os.write(target_fd, view) :]
        copied += len(data)


def upload(root: Path, parts: Sequence[str], path: str, source: Path, owner: int | None) -> None:
    """Copy host file ``source`` to ``root/parts`` (directories made as needed), following no symlink.

    What it makes belongs to ``owner`` where given (the sandbox's uid), so commands can change it.
    """
    if not parts:
        raise SandboxError(f"target {path!r} names the sandbox root, not a file")
    source_fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not hang us
    try:
        if not stat.S_ISREG(os.fstat(source_fd).st_mode):
            raise SandboxError(f"source {source} is not a regular file")
        os.set_blocking(source_fd, True)
        with open_directory(root, parts[:-1], path, create=True, owner=owner) as dir_fd:
            target_fd = _open_file(dir_fd, parts[-1], path, os.O_WRONLY | os.O_CREAT)
            try:
                if owner is not None:
                    os.fchown(target_fd, owner, owner)
                os.ftruncate(target_fd, 0)
                _copy(source_fd, target_fd, None)
            finally:
                os.close(target_fd)
    finally:
        os.close(source_fd)


def download(root: Path, parts: Sequence[str], path: str, target: Path, limit: int) -> None:
    """Copy ``root/parts`` to host file ``target``, refusing files over ``limit`` bytes before copying."""
    if not parts:
        raise SandboxError(f"{path!r} is not a file in the sandbox (it names the sandbox root)")
    with open_directory(root, parts[:-1], path) as dir_fd:
        source_fd = _open_file(dir_fd, parts[-1], path, os.O_RDONLY)
    try:
        size = os.fstat(source_fd).st_size
        if size > limit:
            raise SandboxTransferLimitError(
                f"{path!r} is {size} bytes, over max_transfer_bytes={limit}; nothing was copied "
                "(compress or split it in the sandbox, or raise the provider's limit)"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            copied = _copy(source_fd, target_fd, limit)
        finally:
            os.close(target_fd)
        if copied > limit:  # it grew while we copied
            target.unlink()
            raise SandboxTransferLimitError(
                f"{path!r} grew past max_transfer_bytes={limit} while it was copied; the partial copy was removed"
            )
    finally:
        os.close(source_fd)


def check_directory(root: Path, parts: Sequence[str], path: str | None) -> None:
    with open_directory(root, parts, path or "."):
        pass
