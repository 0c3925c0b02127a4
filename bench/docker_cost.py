"""Docker sandboxes, side by side in one run: ``DockerProvider`` vs NeMo Gym 0.7.0's CLI-based ``docker``
provider vs raw Engine API calls, on the same daemon and image.

Run (in NeMo Gym's venv, which has this package too):
    "$(bash scripts/install-nemo-gym.sh | tail -n 1)" bench/docker_cost.py [ROUNDS] [EXECS]

Each round, in turn for each contender: create a sandbox, run ``true`` EXECS times, close it.
"raw" is the least the Engine API allows: create + start, then per exec create + start (streamed)
+ inspect, then a forced delete, over one httpx connection pool: the daemon's own floor. "ours"
has its spares (the default, ``prestart=True``): its create of the same spec each round takes the
container made ahead; "ours_cold" is ``prestart=False``, a create that finds no spare. The spare's
refill runs in the background during the rest of our round (our execs and close pay for it); the
bench then waits, untimed, until it is made, so it never runs during another contender's round.
Rounds interleave the contenders so machine noise hits all alike; it prints medians and our
ratios. Goals (the issue's): our create + exec + close cycle at most 0.7x NeMo Gym's, our exec at
most 0.9x, our create of the spare's shape at most 0.3x the raw create.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx

from sandbox_middleware import DockerProvider, SandboxSpec

IMAGE = "sandbox-middleware/busybox:test"
SOCKET = "/var/run/docker.sock"


class Raw:
    """Bare Engine API calls: what any client must send at least."""

    name = "raw"

    def __init__(self) -> None:
        transport = httpx.AsyncHTTPTransport(uds=SOCKET)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://docker/v1.41", timeout=60)

    async def create(self, spec: SandboxSpec) -> str:
        body = {
            "Image": IMAGE,
            "Cmd": ["sleep", "1000000"],
            "HostConfig": {"NetworkMode": "none", "Init": True},
            "Labels": {"bench": "raw"},
        }
        container = (await self.client.post("/containers/create", json=body)).json()["Id"]
        await self.client.post(f"/containers/{container}/start")
        return str(container)

    async def exec(self, container: str, command: str) -> None:
        body = {"Cmd": ["/bin/sh", "-c", command], "AttachStdout": True, "AttachStderr": True}
        exec_id = (await self.client.post(f"/containers/{container}/exec", json=body)).json()["Id"]
        async with self.client.stream("POST", f"/exec/{exec_id}/start", json={"Detach": False}) as reply:
            async for _ in reply.aiter_raw():
                pass
        await self.client.get(f"/exec/{exec_id}/json")

    async def close(self, container: str) -> None:
        await self.client.delete(f"/containers/{container}", params={"force": "1", "v": "1"})

    async def aclose(self) -> None:
        await self.client.aclose()


async def _timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await call()
    return (time.perf_counter() - started) * 1000, result


async def _settled(provider: Any) -> None:
    """Until a spare that ``provider`` makes in the background is made (not timed: no other round pays for it)."""
    spares = getattr(provider, "_spares", None)
    if spares is not None:
        await anyio.to_thread.run_sync(spares.wait, 60.0)


async def _round(provider: Any, execs: int, samples: dict[str, list[float]]) -> None:
    spec = SandboxSpec(image=IMAGE)
    took, handle = await _timed(lambda: provider.create(spec))
    samples["create"].append(took)
    for _ in range(execs):
        took, _ = await _timed(lambda: provider.exec(handle, "true"))
        samples["exec"].append(took)
    took, _ = await _timed(lambda: provider.close(handle))
    samples["close"].append(took)
    samples["cycle"].append(samples["create"][-1] + samples["exec"][-execs] + samples["close"][-1])
    await _settled(provider)


async def main(rounds: int, execs: int) -> None:
    from nemo_gym.sandbox.providers.docker import DockerProvider as NemoDockerProvider

    contenders: dict[str, Any] = {
        "ours": DockerProvider(),
        "ours_cold": DockerProvider(prestart=False),
        "nemo_gym": NemoDockerProvider(),
        "raw": Raw(),
    }
    samples = {name: {key: [] for key in ("create", "exec", "close", "cycle")} for name in contenders}
    for provider in contenders.values():  # warm-up: first-use costs (image inspect, pools) out of the figures
        await _round(provider, 1, {key: [] for key in ("create", "exec", "close", "cycle")})
    for _ in range(rounds):
        for name, provider in contenders.items():
            await _round(provider, execs, samples[name])
    for provider in contenders.values():
        await provider.aclose()
    median = {
        name: {key: statistics.median(values) for key, values in parts.items()} for name, parts in samples.items()
    }
    print(f"docker cost: {rounds} rounds, {execs} execs of `true` per sandbox, image {IMAGE} (median ms)")
    names = ("ours", "ours_cold", "nemo_gym", "raw")
    print("".join(f"{name:>11}" for name in ("", *names)) + f"{'ours/nemo':>11}{'ours/raw':>10}{'cold/nemo':>11}")
    for key in ("create", "exec", "close", "cycle"):
        ours, cold, nemo, raw = (median[name][key] for name in names)
        figures = "".join(f"{value:11.1f}" for value in (ours, cold, nemo, raw))
        print(f"{key:>11}{figures}{ours / nemo:10.2f}x{ours / raw:9.2f}x{cold / nemo:10.2f}x")
    ratios = {
        "cycle <= 0.70x NeMo Gym's": (median["ours"]["cycle"] / median["nemo_gym"]["cycle"], 0.7),
        "exec <= 0.90x NeMo Gym's": (median["ours"]["exec"] / median["nemo_gym"]["exec"], 0.9),
        "create (the spare's shape) <= 0.30x raw": (median["ours"]["create"] / median["raw"]["create"], 0.3),
    }
    print(
        "goals: "
        + "; ".join(
            f"{goal}: {got:.2f}x ({'met' if got <= bound else 'NOT met'})" for goal, (got, bound) in ratios.items()
        )
    )


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
