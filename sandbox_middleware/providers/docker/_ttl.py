"""DockerProvider's TTL watchdog: a process of its own that removes containers whose deadline has passed.

A container made with ``spec.ttl_s`` carries its deadline in the label ``EXPIRES`` (seconds since
the epoch), whatever its entrypoint. One watchdog per daemon socket (a ``flock``ed lock file in a
directory only this user can write, ``lock_path``) lists the containers with that label every
``POLL_S`` seconds and force-removes (with their volumes) those past their deadline. It runs in
its own session, apart from the process that started it, so a TTL holds when that process is
killed; it exits once no container with a deadline has been left for ``IDLE_S`` seconds, and after
``DOWN_S`` seconds of a daemon that does not answer.

A spare (``_spares.py``) carries ``SPARE`` (its maker) and no ``EXPIRES``: labels cannot change
once it is taken, so its state is in its name, which only the Engine API can change. Untaken
(``sandbox-<id>-spare``) it is removed at ``SPARE_UNTIL``; taken, it is renamed
``sandbox-<id>-at-<ms>`` (when it was taken) with ``-until-<ms>`` (its TTL's deadline), read by
``deadline_of`` here and by ``list``. The lock's name carries ``v2``: a watchdog of an older
version, which knows no spares, does not keep this one from running beside it; ``v3``: nor one that
leaves the work directories on the host (``_files.py``) of the containers it removes, which this one
removes (``python -m sandbox_middleware.providers.docker._files FILES_ROOT KEY...``).

This file imports only the standard library and httpx: the provider starts it as
``python _ttl.py SOCKET VERSION LOCK [FILES_ROOT]``, which must not pay for importing the package (the
removal of work directories on the host, rare, does).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

import httpx

__all__ = [
    "EXPIRES",
    "FILES",
    "POLL_S",
    "SPARE",
    "SPARE_UNTIL",
    "WatchdogLauncher",
    "deadline_of",
    "is_spare",
    "lock_path",
    "taken_at",
    "taken_name",
]

EXPIRES = "sandbox_middleware.docker.expires_at"
FILES = "sandbox_middleware.docker.files"  # the key of a container's work directory on the host (``_files.py``)
SPARE = "sandbox_middleware.docker.spare"  # a spare's maker (Owner metadata, JSON)
SPARE_UNTIL = "sandbox_middleware.docker.spare_until"  # when an untaken spare is removed (seconds since the epoch)
_TAKEN = re.compile(r"/?sandbox-[0-9a-f]{12}-at-([0-9]{1,16})(?:-until-([0-9]{1,16}))?")
POLL_S = 0.5
IDLE_S = 10.0  # with no container left: a create that started it may not have made its container yet
DOWN_S = 120.0


def _private_dir() -> str:
    """A directory only this user can write: /run/sandbox_middleware for root, else $XDG_RUNTIME_DIR
    when it is ours and 0700, else ``sandbox_middleware-<euid>`` (0700, ours) in the temp directory."""
    euid = os.geteuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if euid == 0:
        directory = "/run/sandbox_middleware"
    elif runtime and _owned(runtime):
        return runtime
    else:
        directory = os.path.join(tempfile.gettempdir(), f"sandbox_middleware-{euid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    if not _owned(directory):
        raise PermissionError(
            f"{directory} is not a directory of uid {euid} with mode 0700 (another user made it?); remove it, "
            "or set XDG_RUNTIME_DIR to a private directory"
        )
    return directory


def _owned(directory: str) -> bool:
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def lock_path(socket: str) -> str:
    """The lock file of the watchdog of ``socket``, in a directory no other user can write."""
    digest = hashlib.sha256(os.path.abspath(socket).encode()).hexdigest()[:16]
    return os.path.join(_private_dir(), f"docker-ttl-v3-{digest}.lock")


def taken_name(sandbox: str, now: float, deadline: float | None) -> str:
    """The name a spare ``sandbox-<id>`` gets when a create takes it: when, and its TTL's deadline."""
    until = "" if deadline is None else f"-until-{int(deadline * 1000)}"
    return f"{sandbox}-at-{int(now * 1000)}{until}"


def taken_at(name: str) -> tuple[float, float | None] | None:
    """When a taken spare was taken and its deadline, from its name; None for any other name."""
    found = _TAKEN.fullmatch(name)
    if found is None:
        return None
    return int(found[1]) / 1000, None if found[2] is None else int(found[2]) / 1000


def is_spare(labels: Mapping[str, str], name: str) -> bool:
    """Whether a container is an untaken spare: ``SPARE`` among its labels and no taken spare's name."""
    return SPARE in labels and taken_at(name) is None


def deadline_of(labels: Mapping[str, str], name: str) -> float | None:
    """When a container of ours is due for removal (None: never): ``EXPIRES``; for a spare, ``SPARE_UNTIL``
    until it is taken, then the deadline in its name. ``ValueError`` for a label that is not a number."""
    if SPARE not in labels:
        return float(labels[EXPIRES]) if EXPIRES in labels else None
    taken = taken_at(name)
    return float(labels.get(SPARE_UNTIL, "0")) if taken is None else taken[1]


def _open_lock(lock: str) -> int:
    return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def _running(lock: str) -> bool:
    """Whether a watchdog holds ``lock`` now."""
    try:
        fd = _open_lock(lock)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


class WatchdogLauncher:
    """Starts the watchdog of one socket when none runs, and reaps the processes it started."""

    def __init__(self, socket: str, version: str, files_root: str = "") -> None:
        self._lock = lock_path(socket)
        self._argv = [sys.executable, os.path.abspath(__file__), socket, version, self._lock, files_root]
        self._started: list[subprocess.Popen[bytes]] = []
        self._guard = threading.Lock()  # creates, and the spare maker's thread

    def ensure(self) -> None:
        with self._guard:
            self._started = [process for process in self._started if process.poll() is None]
            if _running(self._lock):
                return
            self._started.append(
                subprocess.Popen(
                    self._argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    close_fds=True,
                )
            )

    def reap(self) -> None:
        """Collect the exit status of watchdogs that have ended (they are left to run otherwise)."""
        with self._guard:
            self._started = [process for process in self._started if process.poll() is None]


def _expired(client: httpx.Client, now: float) -> tuple[list[tuple[str, str]], bool]:
    """Ids of containers with a deadline (``EXPIRES``) or of spares that are past it, each with its work
    directory's key on the host (``FILES``, or ""), and whether any container with a deadline is left (a
    taken spare without a TTL keeps its spare label, and none)."""
    found = []
    for label in (EXPIRES, SPARE):
        reply = client.get("/containers/json", params={"all": "1", "filters": json.dumps({"label": [label]})})
        reply.raise_for_status()
        found += reply.json()
    due, left = [], False
    for container in found:
        try:
            deadline = deadline_of(container.get("Labels") or {}, str((container.get("Names") or [""])[0]))
        except (TypeError, ValueError):
            continue
        left = left or deadline is not None
        if deadline is not None and deadline <= now:
            due.append((str(container["Id"]), str((container.get("Labels") or {}).get(FILES, ""))))
    return due, left


def _remove_files(root: str, keys: list[str]) -> None:
    """Remove the work directories ``keys`` in ``root`` (their containers were removed), importing the package."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join(part for part in (package, os.environ.get("PYTHONPATH", "")) if part)
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # left: the next sweep removes them
        subprocess.run(
            [sys.executable, "-m", "sandbox_middleware.providers.docker._files", root, *keys],
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )


def main(socket: str, version: str, lock: str, files_root: str = "") -> int:
    fd = _open_lock(lock)
    for _ in range(20):  # a launcher's check holds the lock for an instant
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.01)
    else:
        return 0  # another watchdog serves this socket
    transport = httpx.HTTPTransport(uds=socket)
    with httpx.Client(transport=transport, base_url=f"http://docker/v{version}", timeout=30) as client:
        last_answer = time.monotonic()
        idle_since: float | None = None
        while True:
            try:
                due, any_left = _expired(client, time.time())
                removed = []
                for container, files in due:
                    with contextlib.suppress(httpx.HTTPError):
                        reply = client.delete(f"/containers/{container}", params={"force": "1", "v": "1"})
                        if reply.status_code in (204, 404) and files:
                            removed.append(files)
                if removed and files_root:
                    _remove_files(files_root, removed)
                last_answer = time.monotonic()
            except httpx.HTTPError:
                if time.monotonic() - last_answer > DOWN_S:
                    return 1
                any_left = True
            if not any_left:  # a short grace: a create may be adding one right now
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > IDLE_S:
                    return 0
            else:
                idle_since = None
            time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
