"""Host uids of sandboxes (as root): each live sandbox, of LocalProvider or DockerProvider, holds its own,
on one host, across processes.

A uid is taken by a lease: the file ``/run/llm-sandbox-middleware/uids/<uid>``, locked (``flock``)
for as long as its maker holds it. Taking one draws a uid at random in the range and, if its
lease is held, tries the next ones. A LocalProvider lease is free when nobody holds its lock (its
process closed the sandbox, or died: the kernel drops the lock then, and the sandbox's processes
die with it). A container outlives the process that made it, so a DockerProvider lease also
*claims* the uid for its container (``UidLease.claim``: the daemon's socket and the container, written
into the file): unlocked, such a lease stays held for as long as the daemon says that container
exists, and is free once it answers 404 (removed by ``close``, ``reap``, the TTL watchdog or by
hand); a daemon that does not answer keeps it held, unless its socket is gone and no process of
the host runs as that uid. ``close`` and ``reap`` unlink it at once
(``release_claim``). Released leases are unlinked while still locked, and a taker checks that the
file it locked is still the one at that path, so two processes never both think they hold one uid.
A maker killed (SIGKILL, an OOM kill) leaves its lease's file unlocked: free, and unlinked by the next
``sweep_leases`` (a LocalProvider's construction), so the directory holds only live sandboxes' leases.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from ..._errors import SandboxCreateError

__all__ = [
    "UID_BASE",
    "UID_COUNT",
    "UidLease",
    "draw",
    "lease_directory",
    "lease_uid",
    "release_claim",
    "sweep_leases",
]

# Far above any account or container range in common use; below 2**31: bwrap writes its uid map as a signed int.
UID_BASE, UID_COUNT = 1_500_000_000, 1 << 24
LEASES = Path("/run/llm-sandbox-middleware/uids")
_PROBES = 4096  # leases tried after one draw before giving up (each a failed non-blocking flock)
_ASK_S = 5.0  # how long a taker waits for a daemon to say whether a claimed container exists


def draw() -> int:
    """The uid to try first (random in the range; tests force it to repeat)."""
    return UID_BASE + secrets.randbelow(UID_COUNT)


def lease_directory() -> Path:
    """Where leases live: ``LEASES`` for root (host-wide); another user's (a member of the docker group
    driving a daemon) are its own, in the temp directory: unique among that user's processes only."""
    return LEASES if os.geteuid() == 0 else Path(tempfile.gettempdir()) / f"llm-sandbox-middleware-uids-{os.geteuid()}"


class UidLease:
    """A held lease of one uid: ``release()`` frees it (unlinked while locked, then closed); ``claim()``
    then ``keep()`` hand it to a container, which holds it after this process lets go."""

    def __init__(self, uid: int, fd: int, path: Path) -> None:
        self.uid, self._fd, self._path = uid, fd, path

    def claim(self, socket: str, container: str) -> None:
        """Write the container (a name or id on the daemon at ``socket``) that holds the uid once unlocked."""
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, _claim_text(socket, container), 0)

    def keep(self) -> None:
        """Let go of the lock, leaving the claim: the uid is the container's until the daemon says it is gone."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def release(self) -> None:
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = -1


def _claim_text(socket: str, container: str) -> bytes:
    return json.dumps({"socket": socket, "container": container}).encode() + b"\n"


def _claimed(text: bytes) -> tuple[str, str] | None:
    """The daemon socket and container of a claim; None for a LocalProvider lease (its maker's pid)."""
    try:
        claim = json.loads(text)
        socket, container = claim["socket"], claim["container"]
    except (ValueError, TypeError, KeyError):
        return None
    return (socket, container) if isinstance(socket, str) and isinstance(container, str) else None


def _exists(socket: str, container: str, uid: int) -> bool:
    """Whether the daemon at ``socket`` has ``container``: True unless it answers 404. A daemon that does
    not answer keeps the uid held (with ``live-restore`` its containers outlive it), unless its socket
    is gone and no process of this host runs as ``uid``."""
    if not os.path.exists(socket):
        return _runs_as(uid)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=_ASK_S) as client:
            return client.get(f"http://docker/containers/{container}/json").status_code != 404
    except httpx.HTTPError:
        return True


def _runs_as(uid: int) -> bool:
    """Whether a process in this host's ``/proc`` has ``uid`` (real, effective, saved or filesystem)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status", "rb") as status:
                    uids = next(line for line in status if line.startswith(b"Uid:")).split()[1:]
            except (OSError, StopIteration):
                continue  # it ended meanwhile
            if str(uid).encode() in uids:
                return True
    return False


def _leases_dir(directory: Path) -> int:
    """The lease directory's descriptor: made if missing; ours, mode 0700, a real directory."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(directory.parent, mode=0o755, exist_ok=True)
        os.mkdir(directory, 0o700)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SandboxCreateError(
            f"the uid lease directory {directory} is not this user's private directory "
            f"(uid {info.st_uid}, mode {oct(stat.S_IMODE(info.st_mode))}); remove it"
        )
    return fd


def _locked(dir_fd: int, name: str, *, create: bool) -> int | None:
    """The lease file ``name``, locked by us and still the file at that path; None where another holds it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held, current = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:  # released (unlinked) by its holder after we opened it
        os.close(fd)
        return None
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    if (held.st_dev, held.st_ino) != (current.st_dev, current.st_ino):
        os.close(fd)
        return None
    return fd


def _try(dir_fd: int, directory: Path, uid: int) -> UidLease | None:
    name = str(uid)
    fd = _locked(dir_fd, name, create=True)
    if fd is None:
        return None
    claim = _claimed(os.pread(fd, 4096, 0))
    if claim is not None and _exists(*claim, uid):  # a live container's, though its maker let go
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return UidLease(uid, fd, directory / name)


def lease_uid(directory: Path = LEASES, who: str = "LocalProvider") -> UidLease:
    """A uid of the range that no live sandbox on this host holds, leased to the caller (blocking)."""
    try:
        dir_fd = _leases_dir(directory)
    except (OSError, SandboxCreateError) as exc:
        raise SandboxCreateError(f"{who}: cannot use the uid lease directory {directory}: {exc}") from exc
    try:
        start = draw() - UID_BASE
        for step in range(_PROBES):
            uid = UID_BASE + (start + step) % UID_COUNT
            lease = _try(dir_fd, directory, uid)
            if lease is not None:
                return lease
    except OSError as exc:
        raise SandboxCreateError(f"{who}: cannot lease a sandbox uid in {directory}: {exc}") from exc
    finally:
        os.close(dir_fd)
    raise SandboxCreateError(
        f"{who}: {_PROBES} sandbox uids in a row are held by live sandboxes ({directory}); close some"
    )


def release_claim(directory: Path, uid: int, socket: str, containers: tuple[str, ...]) -> None:
    """Free ``uid`` if its lease is still the claim of one of ``containers`` (its id or name) on ``socket``,
    now removed (blocking). A lease taken over meanwhile, locked by a taker, or missing is left alone."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _unlink_if(dir_fd, str(uid), lambda claim: claim in [(socket, name) for name in containers])
        finally:
            os.close(dir_fd)


def _unlink_if(dir_fd: int, name: str, free: Callable[[tuple[str, str] | None], bool]) -> None:
    """Unlink the lease ``name`` while holding its lock, if ``free`` says so of its claim (None: a
    LocalProvider lease); one another process locks, or that is gone, is left alone."""
    fd = _locked(dir_fd, name, create=False)
    if fd is None:
        return
    try:
        if free(_claimed(os.pread(fd, 4096, 0))):
            os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(fd)


def sweep_leases(directory: Path = LEASES) -> None:
    """Unlink the LocalProvider leases in ``directory`` that nobody locks (their makers were killed: the
    kernel dropped the lock, the file stayed), each while locked, as a release does; a claim is left to
    ``close``, ``reap`` and the next draw of its uid (its container may live on). Best effort (blocking)."""
    if not directory.is_dir():
        return
    with contextlib.suppress(OSError, SandboxCreateError):
        dir_fd = _leases_dir(directory)
        try:
            for name in filter(str.isdigit, os.listdir(dir_fd)):
                with contextlib.suppress(OSError):  # gone meanwhile (released, or swept by another process)
                    _unlink_if(dir_fd, name, lambda claim: claim is None)
        finally:
            os.close(dir_fd)
