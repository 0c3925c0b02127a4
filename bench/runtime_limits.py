"""Which limits hold under each OCI runtime, measured on this machine: the daemon's default (``runc``)
and gVisor's ``runsc`` on one daemon, and optionally Podman's Docker-compatible socket.

Run (the daemon must have ``runsc`` registered; see docs/gvisor.md):
    python bench/runtime_limits.py [PODMAN_SOCKET]

For each contender, a fresh sandbox per limit, and what a command trying to pass it met:
  memory  memory_mib=256, a command allocating 1 GiB: its result, and whether the sandbox lives on
  pids    pids=128, a command starting 1000 sleeps: how many ran, its result, whether the sandbox lives on
  nofile  a command opening files until refused: how many it held (the RLIMIT_NOFILE in force)
  disk    disk_gib=0.01 (10 MiB), a command writing 50 MiB in the work directory: how much it wrote
  cpu     cpu=0.5, two busy loops for 3 s: the container's CPU seconds per wall second (its cgroup's count),
          and how often the quota throttled it
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from sandbox_middleware import DockerProvider, SandboxError, SandboxSpec

IMAGE = "sandbox-middleware/python:test"
OPEN = (
    "import os\nn = 0\ntry:\n    while True:\n        os.open('/dev/null', os.O_RDONLY); n += 1\n"
    "except OSError as e:\n    print(n, e.strerror)"
)
COUNT = "ls -d /proc/[0-9]* | wc -l"


async def _outcome(provider: DockerProvider, limits: dict[str, Any], command: str, after: str = "true") -> str:
    """What ``command`` met under ``limits``: its exit code, error_type and last line, and whether the sandbox
    lives (what ``after`` prints there)."""
    limited = DockerProvider(**{**provider._options, **limits})
    handle = await limited.create(SandboxSpec(image=IMAGE))
    try:
        result = await limited.exec(handle, command, timeout_s=120)
        last = (result.stdout.strip().splitlines() or [""])[-1][:40]
        try:
            alive = "alive, " + ((await limited.exec(handle, after)).stdout.strip() or "ran")
        except SandboxError:
            alive = "sandbox gone"
        return f"exit {result.return_code}, error_type {result.error_type}, {last!r}; then: {alive}"
    finally:
        await limited.aclose()


async def _cpu(provider: DockerProvider, socket: str) -> str:
    limited = DockerProvider(**{**provider._options, "cpu": 0.5})
    handle = await limited.create(SandboxSpec(image=IMAGE))
    path = f"/containers/{handle.sandbox_id}/stats"
    try:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket), base_url="http://d/v1.41") as api:

            async def used() -> float:
                stats = (await api.get(path, params={"stream": "false"}, timeout=60)).json()
                return float(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e9

            before, started = await used(), time.monotonic()
            await limited.exec(handle, "timeout 3 sh -c 'while :; do :; done' & timeout 3 sh -c 'while :; do :; done'")
            rate = (await used() - before) / (time.monotonic() - started)
        return f"{rate:.2f} CPU s per s (2 busy loops), throttled {_throttled(handle.sandbox_id)} times (cpu.stat)"
    finally:
        await limited.aclose()


def _throttled(container: str) -> str:
    """``nr_throttled`` of the container's CPU cgroup on this host (cgroup v1 or v2), or "?" where not found."""
    for stat in Path("/sys/fs/cgroup").glob(f"**/*{container}*/cpu.stat"):
        for line in stat.read_text().splitlines():
            if line.startswith("nr_throttled "):
                return line.split()[1]
    return "?"


async def main(podman: str | None) -> None:
    contenders = {"runc": DockerProvider(), "runsc": DockerProvider(runtime="runsc")}
    if podman:
        contenders["podman"] = DockerProvider(socket=podman)
    checks = {
        "memory": lambda p: _outcome(p, {"memory_mib": 256}, "python3 -c 'x = bytearray(1 << 30); print(len(x))'"),
        "pids": lambda p: _outcome(
            p, {"pids": 128}, "for i in $(seq 1000); do sleep 30 & done 2>/dev/null; echo started", COUNT
        ),
        "nofile": lambda p: _outcome(p, {}, f'python3 -c "{OPEN}"'),
        "disk": lambda p: _outcome(
            p, {"disk_gib": 0.01}, "dd if=/dev/zero of=big bs=1M count=50 2>/dev/null; du -k big | cut -f1"
        ),
    }
    print(f"runtime limits, image {IMAGE} (load {os.getloadavg()[0]:.1f})")
    for name, provider in contenders.items():
        for check, measure in checks.items():
            print(f"{name:7}{check:8}{await measure(provider)}")
        print(f"{name:7}{'cpu':8}{await _cpu(provider, provider._socket)}")
    for provider in contenders.values():
        await provider.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
