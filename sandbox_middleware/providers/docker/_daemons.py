"""What differs between the daemons ``DockerProvider`` speaks to, read once from the daemon's ``/info``.

The OCI runtime a sandbox runs under (``runtime=``: ``runc``, gVisor's ``runsc``, any the daemon has
registered) is checked against the daemon's ``Runtimes`` at construction (Podman's compatible API ignores a
container's runtime: asking it for one other than its default is refused). Under gVisor no process of a
sandbox is a host process (the Sentry, a user-space kernel, runs them), so nothing is killed from the
host. Podman's Docker-compatible API (its ``/info`` carries ``BuildahVersion``) takes the same create
body with what its containers need (``adapt``): explicit ``nofile`` and ``nproc`` ulimits, since its
own defaults (raised to 1048576 and 4194304 for root) cannot be set once every capability is dropped,
and plain tmpfs mounts for the writable directories, since it ignores the tmpfs options of a volume
(the directories were left on the host's disk, unbounded) and, unlike Docker, its archive API sees
plain tmpfs mounts. Its ``top`` forks into the container (and answers nothing while it is frozen): the
kill of a timed-out command reads the container's cgroup instead (``_exec.cgroup_pids``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import DockerRuntimeNotFoundError, DockerUnavailableError

__all__ = ["DEFAULT_SOCKET", "PODMAN_ULIMITS", "Daemon", "daemon_of", "identity_of", "socket_of"]

DEFAULT_SOCKET = "/var/run/docker.sock"

PODMAN_ULIMITS = {"nofile": 1024, "nproc": 4096}
"""Soft and hard limits a Podman container gets where the body sets none: at most what the service itself
may raise to (its own hard limits; a shell's usual 1024 open files), and 4096 processes of the sandbox's
uid, host-wide (RLIMIT_NPROC counts per uid; the pids cgroup bounds each sandbox)."""

_REGISTER = {"runtimes": {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace", "--network=none"]}}}


@dataclass(frozen=True)
class Daemon:
    """The daemon at a socket as the provider uses it: its kind and the runtime its sandboxes run under."""

    kind: str  # "docker" or "podman"
    runtime: str | None  # None: the daemon's default
    default_runtime: str

    @property
    def effective_runtime(self) -> str:
        return self.runtime or self.default_runtime

    @property
    def host_pids(self) -> bool:
        """Whether a sandbox's processes are host processes (not under gVisor: the Sentry runs them)."""
        return self.effective_runtime != "runsc"

    @property
    def exec_pids(self) -> bool:
        """Whether an ended exec's inspect tells a process the runtime never started (``Pid`` 0) from one
        that ran: Docker's does (under runc and runsc); Podman's says ``Pid`` 0 for every ended exec."""
        return self.kind == "docker"

    def adapt(self, body: dict[str, Any]) -> dict[str, Any]:
        """The create body with the runtime named and, for Podman, ulimits where the body sets none and the
        tmpfs volumes as tmpfs mounts (``U``: owned by the container's user, its size kept)."""
        host = body["HostConfig"]
        if self.runtime is not None:
            host["Runtime"] = self.runtime
        if self.kind == "podman":
            ulimits = list(host.get("Ulimits") or [])
            given = {entry["Name"] for entry in ulimits}
            ulimits += [{"Name": n, "Soft": v, "Hard": v} for n, v in PODMAN_ULIMITS.items() if n not in given]
            host["Ulimits"] = ulimits
            tmpfs, kept = dict(host.get("Tmpfs") or {}), []
            for mount in host.get("Mounts") or []:
                options = _tmpfs_options(mount)
                if options is None:
                    kept.append(mount)
                else:
                    tmpfs[mount["Target"]] = options
            host["Mounts"], host["Tmpfs"] = kept, tmpfs
        return body


def _tmpfs_options(mount: Mapping[str, Any]) -> str | None:
    """A tmpfs volume's mount options for Podman's ``Tmpfs`` (its owner as ``U``: Podman refuses ``uid=``,
    and ignores ``mode=``); None for any other mount."""
    driver = ((mount.get("VolumeOptions") or {}).get("DriverConfig") or {}).get("Options") or {}
    if mount.get("Type") != "volume" or driver.get("type") != "tmpfs":
        return None
    options = [o for o in str(driver.get("o", "")).split(",") if o and not o.startswith(("uid=", "gid=", "mode="))]
    return ",".join([*options, "U"])


def socket_of(socket: str | None) -> str:
    """``socket`` as given; unset (None), ``DOCKER_HOST``'s ``unix://`` path as the docker CLI reads it,
    else ``DEFAULT_SOCKET``."""
    if socket is not None:
        return socket
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return DEFAULT_SOCKET
    if host.startswith("unix://"):
        return host.removeprefix("unix://")
    raise DockerUnavailableError(
        f"DockerProvider: DOCKER_HOST={host!r} is not a unix:// socket, and this provider speaks the Engine API over "
        "a UNIX socket only; pass socket= a daemon's UNIX socket (a remote one can be forwarded: "
        "ssh -L /tmp/docker.sock:/var/run/docker.sock HOST)"
    )


def daemon_of(info: Mapping[str, Any], runtime: str | None, socket: str) -> Daemon:
    """The daemon its ``/info`` describes; ``DockerRuntimeNotFoundError`` where it has no ``runtime``."""
    kind = "podman" if "BuildahVersion" in info else "docker"
    runtimes = info.get("Runtimes")
    known = sorted(runtimes) if isinstance(runtimes, Mapping) else []
    default = str(info.get("DefaultRuntime") or "runc")
    if runtime is not None and runtime not in known:
        where = (
            "Podman: add it to [engine.runtimes] in containers.conf"
            if kind == "podman"
            else f"register it in /etc/docker/daemon.json, e.g. {json.dumps(_REGISTER)}, and restart dockerd"
        )
        raise DockerRuntimeNotFoundError(
            f"DockerProvider: the daemon at {socket} has no runtime {runtime!r} (it has: "
            f"{', '.join(known) or 'none listed'}); {where} (gVisor: apt-get install runsc), or leave runtime unset "
            f"for the daemon's default ({default})"
        )
    if kind == "podman" and runtime not in (None, default):
        raise DockerRuntimeNotFoundError(
            f"DockerProvider: the Podman service at {socket} ignores a container's runtime in its Docker-compatible "
            f"API (its sandboxes would run under {default}, not {runtime}); make {runtime} the service's default "
            f'instead ([engine] runtime = "{runtime}" in containers.conf) and leave runtime unset'
        )
    return Daemon(kind, runtime, default)


def identity_of(info: Mapping[str, Any], socket: str) -> str:
    """What tells the daemon of ``info`` (its ``/info``) from any other, the same in every process: Docker's
    ``ID`` and data root (two daemons of one host share an ``ID``, Docker 20.10's from ``/etc/docker/key.json``,
    never a data root); Podman's ``ID`` changes at every call, so its host name and storage root (else the socket)."""
    if "BuildahVersion" in info:
        return f"podman:{info.get('Name')}:{info.get('DockerRootDir') or socket}"
    return f"{info.get('ID') or socket}:{info.get('DockerRootDir') or socket}"
