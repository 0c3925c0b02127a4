"""How LocalProvider starts a sandbox's command starter under bubblewrap, with no privilege on the host.

Once per sandbox, at create (``_starter.py`` then starts each command inside). As root, bwrap alone
would leave the sandbox as host uid 0 without capabilities, and uid 0 still owns ``/proc/sys`` and
the kernel keyrings. So the chain drops to an unprivileged host uid first (``setpriv``), bwrap then
maps it to uid 0 of a fresh user namespace, and a seccomp filter (``_seccomp.py``) denies the
kernel keyring calls and a few other syscalls that only widen the kernel's attack surface. Options
travel through a memfd (``bwrap --args``), never through the host helpers' own environment (no
``LD_PRELOAD`` reaches a host-side process) or argv; commands' environments go to the starter.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ..._errors import BwrapUnavailableError
from .._common._arguments import SYSTEM_DIRS
from ._launch import Launch
from ._seccomp import seccomp_program

__all__ = [
    "BASE_PATH",
    "HOST_ENV",
    "OWN_ETC",
    "STARTER_CAPS",
    "BwrapCommand",
    "memfd",
]

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STARTER_CAPS = ("CAP_SYS_ADMIN", "CAP_SETPCAP", "CAP_NET_ADMIN")  # the starter's, in the sandbox's user namespace
HOST_ENV = {"PATH": BASE_PATH}  # all the host-side helpers (sh, setpriv, bwrap) ever get
_ETC_FILES = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
    "/etc/nsswitch.conf", "/etc/os-release", "/etc/mime.types",
)  # fmt: skip
OWN_ETC = {
    "passwd": "root:x:0:0:root:/workspace:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "hostname": "sandbox\n",
}
# /dev without a terminal: no devpts, no ptmx (a sandbox could take every pty outside the host's reserve).
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_NO_PTY_DEV = [
    "--tmpfs", "/dev", *(arg for name in _DEVICES for arg in ("--dev-bind", f"/dev/{name}", f"/dev/{name}")),
    "--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/proc/self/fd/0", "/dev/stdin",
    "--symlink", "/proc/self/fd/1", "/dev/stdout", "--symlink", "/proc/self/fd/2", "/dev/stderr",
]  # fmt: skip


def memfd(name: str, data: bytes) -> int:
    """A memfd holding ``data``, read from offset 0, close-on-exec (closed again on any failure)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class BwrapCommand:
    """Builds the command line of a sandbox's command starter.

    As root, each command drops to the sandbox's own unprivileged host uid (``drops_privileges``);
    otherwise bwrap runs as this process's user.
    """

    def __init__(self, *, ro_paths: Sequence[str]) -> None:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise BwrapUnavailableError(
                "LocalProvider(isolation='bwrap'): no 'bwrap' executable on PATH; install "
                "bubblewrap (apt-get install -y bubblewrap) or use isolation='none'"
            )
        self._bwrap = bwrap
        self._setpriv: str | None = None
        if os.geteuid() == 0:
            self._setpriv = shutil.which("setpriv")
            if self._setpriv is None:
                raise BwrapUnavailableError(
                    "LocalProvider(isolation='bwrap') as root needs 'setpriv' (util-linux) to drop to an "
                    "unprivileged uid before bwrap; install util-linux"
                )
        self._ro_paths = tuple(ro_paths)
        self._seccomp = seccomp_program()
        self._system = []
        for directory in SYSTEM_DIRS:
            if os.path.islink(directory):
                self._system += ["--symlink", os.readlink(directory), directory]
            elif os.path.isdir(directory):
                self._system += ["--ro-bind", directory, directory]
        for path in _ETC_FILES:
            self._system += ["--ro-bind-try", path, path]

    @property
    def seccomp(self) -> bool:
        return self._seccomp is not None

    @property
    def drops_privileges(self) -> bool:
        return self._setpriv is not None

    def _prefix(self, uid: int | None) -> list[str]:
        if self._setpriv is None:
            return [self._bwrap]
        assert uid is not None and uid != 0
        return [
            self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", self._bwrap,
        ]  # fmt: skip

    def argv(
        self, outer: Path, view_root: PurePosixPath, command: Sequence[str], launch: Launch, fds: list[int]
    ) -> list[str]:
        """The argv of a sandbox's command starter (``_starter.py``); the descriptors to pass are appended
        to ``fds`` (the caller closes them once the process started, or when this fails half-way).

        The starter alone gets ``CAP_SYS_ADMIN``, ``CAP_SETPCAP`` and ``CAP_NET_ADMIN`` in the sandbox's
        user namespace, to give each command namespaces of its own and then drop every capability
        before the command starts; commands get their environment and cwd from it, not from bwrap.
        """
        options = [
            "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "0", "--gid", "0",
            "--cap-drop", "ALL", *(arg for cap in STARTER_CAPS for arg in ("--cap-add", cap)),
            "--new-session", "--die-with-parent", "--hostname", "sandbox", *self._system,
        ]  # fmt: skip
        for name in OWN_ETC:
            options += ["--ro-bind", str(outer / "etc" / name), f"/etc/{name}"]
        options += ["--proc", "/proc", *(["--dev", "/dev"] if launch.pty else _NO_PTY_DEV)]
        options += ["--bind", str(outer / "shm"), "/dev/shm"]
        options += ["--bind", str(outer / "tmp"), "/tmp"]
        for path in self._ro_paths:  # after /tmp, which would hide one below it
            options += ["--ro-bind", path, path]
        options += ["--bind", str(outer / "box"), str(view_root), "--remount-ro", "/dev", "--remount-ro", "/"]
        options += ["--chdir", str(view_root), "--clearenv"]
        if self._seccomp is not None:
            fds.append(memfd("sandbox-seccomp", self._seccomp))
            options += ["--add-seccomp-fd", str(fds[-1])]
        fds.append(memfd("sandbox-args", b"".join(os.fsencode(option) + b"\0" for option in options)))
        return [*self._prefix(launch.uid), "--args", str(fds[-1]), "--", *command]
