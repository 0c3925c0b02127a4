"""What an OCI runtime costs a ``DockerProvider`` sandbox, side by side in one run: the daemon's default
runtime (``runc``) against gVisor's ``runsc`` on the same daemon and image, and optionally Podman's
Docker-compatible socket (its default runtime).

Run (the daemon must have ``runsc`` registered; see docs/gvisor.md):
    python bench/runtime_cost.py [ROUNDS] [EXECS] [PODMAN_SOCKET]

Each round, in turn for each contender: create a sandbox, run ``true`` EXECS times, then two commands
that show where gVisor's cost lies (``syscalls``: 20,000 one-byte reads and writes through ``dd``, each a
system call the user-space kernel serves; ``cpu``: a shell loop of 20,000 additions, few system calls),
close it. Rounds interleave the contenders so machine noise hits all alike; it prints medians and the
ratios to the first contender.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import anyio

from sandbox_middleware import DockerProvider, SandboxSpec

IMAGE = "sandbox-middleware/busybox:test"
WORK = {
    "syscalls": "dd if=/dev/zero of=/dev/null bs=1 count=20000 2>/dev/null",
    "cpu": "i=0; while [ $i -lt 20000 ]; do i=$((i + 1)); done",
}
PARTS = ("create", "exec", *WORK, "close", "cycle")


async def _sample(provider: DockerProvider, execs: int, samples: dict[str, list[float]]) -> None:
    """One round of one contender: each part's wall time, in milliseconds, appended to ``samples``."""
    clock = time.perf_counter
    started = clock()
    handle = await provider.create(SandboxSpec(image=IMAGE))
    samples["create"].append((clock() - started) * 1000)
    for _ in range(execs):
        began = clock()
        assert (await provider.exec(handle, "true")).return_code == 0
        samples["exec"].append((clock() - began) * 1000)
    for name, command in WORK.items():
        began = clock()
        result = await provider.exec(handle, command)
        assert result.return_code == 0, result
        samples[name].append((clock() - began) * 1000)
    began = clock()
    await provider.close(handle)
    samples["close"].append((clock() - began) * 1000)
    samples["cycle"].append(samples["create"][-1] + samples["exec"][-execs] + samples["close"][-1])


async def main(rounds: int, execs: int, podman: str | None) -> None:
    contenders = {"runc": DockerProvider(), "runsc": DockerProvider(runtime="runsc")}
    if podman:
        contenders["podman"] = DockerProvider(socket=podman)
    samples: dict[str, dict[str, list[float]]] = {name: {part: [] for part in PARTS} for name in contenders}
    for provider in contenders.values():  # warm-up: image inspect, connection pools
        await _sample(provider, 1, {part: [] for part in PARTS})
    for _ in range(rounds):
        for name, provider in contenders.items():
            await _sample(provider, execs, samples[name])
    for provider in contenders.values():
        await provider.aclose()
    median: dict[str, dict[str, Any]] = {
        name: {part: statistics.median(values) for part, values in parts.items()} for name, parts in samples.items()
    }
    names = list(contenders)
    print(f"runtime cost: {rounds} rounds, {execs} execs of `true` per sandbox, image {IMAGE} (median ms)")
    print(
        f"{'':10}" + "".join(f"{name:>10}" for name in names) + "".join(f"{name + '/runc':>13}" for name in names[1:])
    )
    for part in PARTS:
        row = [median[name][part] for name in names]
        print(
            f"{part:10}" + "".join(f"{value:10.1f}" for value in row) + "".join(f"{v / row[0]:12.2f}x" for v in row[1:])
        )


if __name__ == "__main__":
    arguments = sys.argv[1:]
    anyio.run(
        main,
        int(arguments[0]) if arguments else 10,
        int(arguments[1]) if len(arguments) > 1 else 5,
        arguments[2] if len(arguments) > 2 else None,
    )
