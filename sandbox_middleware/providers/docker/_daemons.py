"""What differs between the daemons ``DockerProvider`` speaks to, read once from the daemon's ``/info``.

The OCI runtime a sandbox runs under (``runtime=``: ``runc``, gVisor's ``runsc``, any the daemon has
registered) is checked against the daemon's ``Runtimes`` at construction. Podman's Docker-compatible
API (its ``/info`` carries ``BuildahVersion``) takes the same create body with what its containers need
added (``adapt``): explicit ``nofile`` and ``nproc`` ulimits, since its own defaults (raised to
1048576 and 4194304 for root) cannot be set once every capability is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import DockerRuntimeNotFoundError

__all__ = ["PODMAN_ULIMITS", "Daemon", "daemon_of"]

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

    def adapt(self, body: dict[str, Any]) -> dict[str, Any]:
        """The create body with the runtime named, and Podman's ulimits where the body sets none."""
        host = body["HostConfig"]
        if self.runtime is not None:
            host["Runtime"] = self.runtime
        if self.kind == "podman":
            ulimits = list(host.get("Ulimits") or [])
            given = {entry["Name"] for entry in ulimits}
            ulimits += [{"Name": n, "Soft": v, "Hard": v} for n, v in PODMAN_ULIMITS.items() if n not in given]
            host["Ulimits"] = ulimits
        return body


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
    return Daemon(kind, runtime, default)
