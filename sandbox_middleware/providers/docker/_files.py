"""DockerProvider's work directories on the host: a tmpfs this process mounts and binds into the container,
so that a snapshot freezes it in place and a fork's files are an overlay on the snapshot's, with no copy
(LocalProvider's layers: ``../local/_layers.py``, its snapshot records ``../local/_snapshots.py``).

Used (``usable``) where this process is root beside the daemon, in its mount namespace (the socket's peer
process is), the sandboxes' processes are host processes (runc: gVisor's Gofer would not see a mount made
on the directory later), the daemon is Docker (not Podman) and remaps no uid; else, and for an unbounded
work directory (``disk_gib=None``), the work directory is a tmpfs volume (``_container._tmpfs``).

- A sandbox's directory is ``<root>/box-<16 hex>`` (its container's ``FILES`` label names it): a tmpfs of
  its ``disk_gib`` (root's, 0711) holding ``box/`` (the sandbox's uid's, 0700), a shared mount of its own,
  bound into the container with ``bind-propagation=rslave``: what is mounted on box/ later (a snapshot's
  overlay, a fork's) shows in the running container at once, and in the daemon's archive API.
- It is made before its container, under its ``flock`` (shared) until the container exists, and removed
  after the container by whoever removes that: ``close``, a failed create, a spare's removal, the TTL
  watchdog (``python -m sandbox_middleware.providers.docker._files ROOT KEY...``), and ``sweep`` (at
  construction and ``aclose``: directories no container names, asked again once no create holds them).
- A snapshot of the whole work directory (``take``): with the container paused (the daemon's cgroup
  freezer), running no process besides its own (``_kept``: a command's could hold the work directory
  where no listing shows it) and those holding nothing of it (a cwd, an open file, a mapping, a socket),
  ``_layers.rotate`` makes its files a read-only layer, kept in ``<root>`` as a
  LocalProvider snapshot record (``snap-`` ids), and the sandbox goes on in an overlay on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..._owner import Owner
from ..._protocol import SandboxSnapshot
from ..local._copies import DIRECTORY
from ..local._layers import read_view, rotate
from ..local._mounts import mount_tmpfs, probe_tmpfs, share
from ..local._records import directories_of, makers, remove_box
from ..local._snapshots import SNAPSHOT_ID, release, retired
from ._daemons import Daemon
from ._exec import cgroup_pids
from ._ttl import FILES

__all__ = ["ROOT", "Files", "root_of", "usable"]

ROOT = Path("/run/sandbox_middleware/docker-files")  # root's: beside the TTL watchdog's lock (``_ttl.py``)
_KEY = re.compile(r"box-[0-9a-f]{16}")
_LOCK = ".lock"  # beside a work directory: flocked by its create until its container exists
_YOUNG_S = 60.0  # a lock file without its directory is left this long to its create


def usable(socket_path: str, daemon: Daemon, remapped: bool) -> str | None:
    """Why the work directories cannot be this process's tmpfs mounts (None: they can)."""
    if os.geteuid() != 0:
        return "this process is not root"
    if daemon.kind != "docker":
        return "the daemon is Podman"
    if not daemon.host_pids:
        return "gVisor (runsc) reads the directory through its Gofer, which sees no mount made on it later"
    if remapped:
        return "the daemon remaps uids"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.settimeout(5)
            peer.connect(socket_path)
            pid = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino:
            return "the daemon runs in another mount namespace"
    except OSError as exc:
        return f"the daemon's process is not seen here ({exc.strerror or exc})"
    if not probe_tmpfs():
        return "this process may not mount"
    return None


def live_keys(socket_path: str, version: str, key: str | None = None) -> set[str] | None:
    """The work directory keys the containers on the daemon carry (``FILES``; only ``key``, if given;
    None: the daemon did not answer)."""
    params = {"all": "1", "filters": json.dumps({"label": [FILES if key is None else f"{FILES}={key}"]})}
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url=f"http://docker/v{version}") as api:
            reply = api.get("/containers/json", params=params, timeout=30)
            reply.raise_for_status()
            return {str((container.get("Labels") or {}).get(FILES)) for container in reply.json()}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def root_of(identity: str) -> Path:
    """The directory of one daemon's work directories and snapshots (``identity``: ``_daemons.identity_of``)."""
    return ROOT / hashlib.sha256(identity.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Files:
    """The work directories and snapshots of one daemon's sandboxes, in ``root`` (root's, 0700)."""

    root: Path

    def outer(self, key: str) -> Path:
        """The directory of the sandbox whose ``FILES`` label is ``key`` (a label is read from the daemon:
        never a path of its own choosing)."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"{key!r:.80} is not a work directory's key")
        return self.root / key

    @contextlib.contextmanager
    def made(self, size: int, owner: tuple[int, int]) -> Iterator[str]:
        """A new work directory of ``size`` bytes owned by ``owner``, its key yielded; held from removal by
        a sweep until the block ends (its container exists by then: its lock file, ``flock``ed before the
        directory is made), removed if the block fails."""
        for directory in (self.root.parents[1], self.root.parents[0], self.root):  # the first: the watchdog's too
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
        key = f"box-{os.urandom(8).hex()}"
        lock = os.open(
            self.root / f"{key}{_LOCK}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                os.mkdir(self.root / key, 0o700)
                mount_tmpfs(self.root / key, size)
                os.mkdir(self.root / key / "box", 0o700)
                os.chown(self.root / key / "box", *owner)
                share(self.root / key / "box")
                yield key
            except BaseException:
                self.remove(key)
                raise
        finally:
            os.close(lock)

    def remove(self, key: str) -> list[str]:
        """Unmount and delete a work directory (its container is gone) and its lock file; what could not be removed."""
        outer = self.outer(key)
        failed = remove_box(outer, True, []) if os.path.lexists(outer) else []
        if not failed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / f"{key}{_LOCK}")
        return failed

    def sweep(self, socket_path: str, version: str) -> list[str]:
        """Remove the work directories that no container on the daemon names and no create holds, the
        snapshots whose maker died making them, and deleted snapshots' leftovers (blocking); what could
        not be removed. Nothing when the daemon does not answer."""
        failed: list[str] = []
        live = live_keys(socket_path, version)
        if live is None or not self.root.is_dir():
            return failed
        for name in os.listdir(self.root):
            key = name.removesuffix(_LOCK)
            if not _KEY.fullmatch(key) or key in live:
                continue
            if name == key or not os.path.lexists(self.root / key):
                with contextlib.suppress(FileNotFoundError), self._unheld(key, young=name != key) as free:
                    if free and live_keys(socket_path, version, key) == set():  # not made since the list
                        failed += self.remove(key)
        for snapshot_id, record in makers(self.root, SNAPSHOT_ID):
            owner = Owner.from_metadata(record)
            if owner is not None and owner.alive() is False:
                for outer in directories_of(self.root, snapshot_id):
                    failed += remove_box(outer, False, [])
        for snapshot_id in retired(self.root):
            failed += release(self.root, snapshot_id)
        return failed

    @contextlib.contextmanager
    def _unheld(self, key: str, young: bool) -> Iterator[bool]:
        """Whether no create holds work directory ``key`` (its lock file free, or gone), held so for the
        block. ``young``: its lock file alone, left to a create that may not have locked it yet for a minute."""
        try:
            fd = os.open(self.root / f"{key}{_LOCK}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            yield True
            return
        try:
            if young and time.time() - os.fstat(fd).st_mtime < _YOUNG_S:
                yield False
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def take(
        self,
        key: str,
        init: int,
        tini: bool,
        uid: int,
        metadata: dict[str, str],
        image: str,
        path: str,
        provider: str,
    ) -> SandboxSnapshot | None:
        """A snapshot of the work directory ``key`` of the paused container whose init is host pid ``init``
        (``tini``: Docker's init, its main process the init's first child) (blocking), recorded as taken of
        ``image``; None when it runs a process besides those (``_kept``), or one of those holds the work directory (or
        ``_layers.rotate`` cannot take one now): the caller copies."""
        outer = self.outer(key)
        room = os.statvfs(outer)
        size = room.f_blocks * room.f_frsize
        return rotate(self.root, outer, _Paused(init, tini, outer), uid, size, metadata, image, path, provider)


@dataclass(frozen=True)
class _Paused:
    """A container the daemon paused (``_layers.Freezer``): busy while it runs any process besides its own
    (``_kept``; a command, or one a command left, could hold the work directory in ways no ``/proc``
    listing shows: a descriptor in a socket's queue, a thread's own cwd), or while one of its own holds
    its work directory (``outer/box``, what is mounted there) or anything that could carry it."""

    init: int
    tini: bool
    outer: Path

    def frozen(self) -> contextlib.AbstractContextManager[bool]:
        return contextlib.nullcontext(True)

    def busy(self) -> bool:
        pids = cgroup_pids(self.init)
        if pids is None:
            return True
        if set(pids) - _kept(self.init, self.tini, pids):
            return True
        view = read_view(self.outer)
        written = [self.outer / "box", *([] if view is None or view.upper is None else [self.outer / view.upper])]
        devices = set()
        for tree in written:  # what a process could write through: the view, and its upper layer's own
            fd = os.open(tree, DIRECTORY)
            try:
                devices.add(os.fstat(fd).st_dev)
            finally:
                os.close(fd)
        return any(_holds(pid, devices) for pid in pids)

    def thaw(self) -> None:
        """Nothing: the daemon's unpause is the caller's, and one left paused by a killed maker stays so."""


def _kept(init: int, tini: bool, pids: list[int]) -> set[int]:
    """The processes of ``pids`` that are the container's own: its init, the first process it started (the
    main process: a command's orphan is adopted by the init later) and, under Docker's init (``tini``),
    that one's descendants (the keep-alive's ``sleep``); unreadable ones are not."""
    parents: dict[int, int] = {}
    started: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat_file:
                fields = stat_file.read().rpartition(b")")[2].split()
            parents[pid], started[pid] = int(fields[1]), int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
    children = [pid for pid, parent in parents.items() if parent == init]
    kept = {init}
    if children:
        tops = [min(children, key=lambda pid: (started[pid], pid))]
        while tops:
            kept.update(tops)
            tops = [pid for pid, parent in parents.items() if parent in tops and pid not in kept] if tini else []
    return kept


def _holds(pid: int, devices: set[int]) -> bool:
    """Whether a thread of process ``pid`` has its cwd, or the process an open file or a mapped file, on one of
    ``devices``, or a descriptor that could carry one (a socket's queue, an io_uring's files, an epoll's);
    unreadable: it may."""
    proc = Path(f"/proc/{pid}")
    try:
        for task in os.listdir(proc / "task"):  # a thread made without CLONE_FS, CLONE_FILES has its own
            thread = proc / "task" / task
            if os.stat(thread / "cwd").st_dev in devices:
                return True
            for name in os.listdir(thread / "fd"):
                target = os.readlink(thread / "fd" / name)
                if target.startswith(("socket:", "anon_inode:")):
                    return True
                if not target.startswith("pipe:") and os.stat(thread / "fd" / name).st_dev in devices:
                    return True
        with open(proc / "maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) >= 5 and fields[4] != "0":
                    major, _, minor = fields[3].partition(":")
                    if os.makedev(int(major, 16), int(minor, 16)) in devices:
                        return True
    except (OSError, ValueError):  # unreadable, or ended though frozen (its leader gone, say): it may hold them
        return True
    return False


def main(arguments: Sequence[str]) -> int:
    """``ROOT KEY...``: remove these work directories (their containers were removed: the TTL watchdog's)."""
    files = Files(Path(arguments[0]))
    if not files.root.is_dir() or stat.S_IMODE(os.stat(files.root).st_mode) & 0o077:
        return 2
    failed = [failure for key in arguments[1:] if _KEY.fullmatch(key) for failure in files.remove(key)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
