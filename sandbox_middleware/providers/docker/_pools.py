"""The host's shared kernel pools, bounded per DockerProvider sandbox: what the create body asks the daemon
for, and what the provider writes from the host where the daemon does not apply it.

- open files: ``RLIMIT_NOFILE`` (``HostConfig.Ulimits`` ``nofile``) per process, times the pids limit
  per sandbox; processes also by ``RLIMIT_NPROC`` (``nproc``, per uid: the sandbox's own);
- ptys: none (``/dev/pts`` hidden under a read-only tmpfs of 4 KiB, so ``/dev/ptmx``, a link into
  it, opens nothing), or a devpts instance of its own with ``max=ptys``;
- TCP buffers: on cgroup v1, ``memory.kmem.tcp.limit_in_bytes`` of the container's memory cgroup,
  written from the host after start (Docker 20.10 with runc 1.1 does not apply ``KernelMemoryTCP``);
  on v2 socket memory is charged to ``memory.max`` by the kernel;
- message queues (``RLIMIT_MSGQUEUE``, ``msgqueue``) and inotify instances and watches: per uid,
  each sandbox's own once its uid is (``_common/_uids.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["MSGQUEUE_BYTES", "bound_tcp", "pts_mount", "ulimits"]

MSGQUEUE_BYTES = 819_200  # the kernel's default RLIMIT_MSGQUEUE, per uid: whatever the daemon's own is
_MEMORY_V1 = Path("/sys/fs/cgroup/memory")


def ulimits(nofile: int, nproc: int | None) -> list[dict[str, Any]]:
    """``HostConfig.Ulimits``: soft and hard alike, so a command cannot raise them."""
    limits = {"nofile": nofile, "msgqueue": MSGQUEUE_BYTES}
    if nproc is not None:
        limits["nproc"] = nproc
    return [{"Name": name, "Soft": value, "Hard": value} for name, value in limits.items()]


def pts_mount(ptys: int) -> dict[str, Any]:
    """What is mounted at ``/dev/pts``: ``ptys`` pseudo-terminals at most (0: none)."""
    if not ptys:
        return {"Type": "tmpfs", "Target": "/dev/pts", "ReadOnly": True, "TmpfsOptions": {"SizeBytes": 4096}}
    options = f"newinstance,ptmxmode=0666,mode=0620,max={ptys}"
    return {
        "Type": "volume",
        "Target": "/dev/pts",
        "VolumeOptions": {
            "DriverConfig": {"Name": "local", "Options": {"type": "devpts", "device": "devpts", "o": options}}
        },
    }


def tcp_v1() -> bool:
    """Whether this process can bound a container's TCP buffers from the host (root, cgroup v1 memory)."""
    return os.geteuid() == 0 and (_MEMORY_V1 / "memory.kmem.tcp.limit_in_bytes").exists()


def bound_tcp(container: str, pid: int, limit: int) -> str | None:
    """Write ``limit`` to the v1 ``memory.kmem.tcp.limit_in_bytes`` of ``container`` (host pid ``pid`` of
    its init): None once done, else why not (the pid is not the container's in this host's ``/proc``)."""
    try:
        with open(f"/proc/{pid}/cgroup") as groups:
            lines = groups.read().splitlines()
    except OSError as exc:
        return f"cannot read /proc/{pid}/cgroup: {exc}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            if container not in path:
                return f"pid {pid} is not in the memory cgroup of container {container[:12]} here"
            target = _MEMORY_V1 / path.lstrip("/") / "memory.kmem.tcp.limit_in_bytes"
            try:
                target.write_text(str(limit))
            except OSError as exc:
                return f"cannot write {target}: {exc}"
            return None
    return f"pid {pid} has no v1 memory cgroup"
