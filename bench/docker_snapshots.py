"""DockerProvider snapshots: a prepared state of 200 MB in 10,000 files, then 8 forks of it, against one
empty create, doing the preparation 8 times, and uploading the files 8 times.

Run: ``python bench/docker_snapshots.py [FORKS] [FILES] [FILE_BYTES]`` (defaults 8, 10000, 20000).

Times, on the daemon of ``DOCKER_HOST`` (or /var/run/docker.sock): one empty create (no spare); the
preparation in one sandbox (a shell loop writing the files); the snapshot; FORKS creates from it at
once (to all ready: the files restored in each); FORKS sandboxes each preparing the state itself; FORKS
sandboxes each given the files by ``upload_file`` (every file, FORKS at once; with ``BENCH_UPLOAD=1``).
Disk: the snapshot image's own layer (its size less its base image's) and the forks' writable layers (``SizeRw``); their
tmpfs directories hold the state in memory, not on disk. Everything made is removed at the end.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import anyio
import httpx

from sandbox_middleware import DockerProvider, SandboxHandle, SandboxSpec

IMAGE = "sandbox-middleware/busybox:test"
SOCKET = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
UPLOAD = os.environ.get("BENCH_UPLOAD") == "1"  # the upload_file contender: 80,000 uploads, minutes here
SPEC = SandboxSpec(image=IMAGE, metadata={"bench": "docker_snapshots"}, resources={"memory_mib": 2048})


def _prepare(files: int, size: int) -> str:
    per = 100
    return (
        f"for d in $(seq 0 {files // per - 1}); do mkdir -p state/d$d; "
        f"for f in $(seq 0 {per - 1}); do head -c {size} /dev/urandom > state/d$d/f$f; done; done"
    )


async def _all(calls: list[Callable[[], Awaitable[SandboxHandle]]]) -> list[SandboxHandle]:
    """The handles of ``calls`` made at once."""
    handles: list[SandboxHandle] = []

    async def one(call: Callable[[], Awaitable[SandboxHandle]]) -> None:
        handles.append(await call())

    async with anyio.create_task_group() as group:
        for call in calls:
            group.start_soon(one, call)
    return handles


def _disk(snapshot_id: str, forks: set[str]) -> tuple[int, int]:
    """Bytes of the snapshot image's own layer, and of the forks' writable layers."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=SOCKET), base_url="http://docker/v1.41", timeout=300) as engine:
        image = engine.get(f"/images/sandbox-middleware/snapshot:{snapshot_id}/json").json()
        base = engine.get(f"/images/{IMAGE}/json").json()
        listed = engine.get("/containers/json", params={"size": "1", "all": "1"}).json()
    return int(image["Size"]) - int(base["Size"]), sum(int(c.get("SizeRw") or 0) for c in listed if c["Id"] in forks)


async def _uploads(provider: DockerProvider, made: list[SandboxHandle], forks: int, files: int, size: int) -> float:
    """Seconds to ``forks`` sandboxes each given the files by ``upload_file``, all at once."""
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder)
        for index in range(files):
            (local / f"f{index}").write_bytes(os.urandom(size))
        started = time.perf_counter()
        uploaded = await _all([partial(provider.create, SPEC) for _ in range(forks)])
        made += uploaded

        async def fill(handle: SandboxHandle) -> None:
            for index in range(files):
                await provider.upload_file(handle, local / f"f{index}", f"state/d{index // 100}/f{index % 100}")

        async with anyio.create_task_group() as group:
            for handle in uploaded:
                group.start_soon(fill, handle)
        return time.perf_counter() - started


async def main(forks: int, files: int, size: int) -> None:
    provider = DockerProvider(prestart=False, disk_gib=1, max_transfer_bytes=1 << 30)
    made: list[SandboxHandle] = []
    try:
        started = time.perf_counter()
        empty = await provider.create(SPEC)
        create_s = time.perf_counter() - started
        made.append(empty)

        parent = await provider.create(SPEC)
        made.append(parent)
        started = time.perf_counter()
        result = await provider.exec(parent, _prepare(files, size), timeout_s=3600)
        assert result.return_code == 0, result
        prepare_s = time.perf_counter() - started

        started = time.perf_counter()
        snapshot = await provider.snapshot(parent, paths=["state"])
        snapshot_s = time.perf_counter() - started

        started = time.perf_counter()
        children = await _all([partial(provider.create, SPEC, from_snapshot=snapshot) for _ in range(forks)])
        forks_s = time.perf_counter() - started
        made += children
        counted = await provider.exec(children[-1], "find state -type f | wc -l; du -sk state")
        layer, rw = await anyio.to_thread.run_sync(_disk, snapshot.snapshot_id, {c.sandbox_id for c in children})

        started = time.perf_counter()
        again = await _all([partial(provider.create, SPEC) for _ in range(forks)])
        made += again
        async with anyio.create_task_group() as group:
            for handle in again:
                group.start_soon(partial(provider.exec, handle, _prepare(files, size), timeout_s=3600))
        prepare_all_s = time.perf_counter() - started

        upload_s = await _uploads(provider, made, forks, files, size) if UPLOAD else None

        await provider.delete_snapshot(snapshot)
        print(f"state: {files} files of {size} bytes ({files * size / 1e6:.0f} MB); in a fork: {counted.stdout!r}")
        print(f"load average at the end: {os.getloadavg()}")
        print(f"one empty create (no spare): {create_s:.2f} s")
        print(f"preparing the state once: {prepare_s:.2f} s; the snapshot: {snapshot_s:.2f} s")
        print(f"{forks} forks ready: {forks_s:.2f} s ({forks_s / create_s:.1f}x one empty create)")
        print(f"{forks} sandboxes preparing it each: {prepare_all_s:.2f} s")
        if upload_s is not None:
            print(f"{forks} sandboxes given the files by upload_file: {upload_s:.2f} s")
        print(
            f"disk: the snapshot's layer {layer / 1e6:.1f} MB, the {forks} forks' writable layers {rw / 1e6:.1f} MB "
            f"(their state is in their tmpfs: {forks} x {files * size / 1e6:.0f} MB of memory)"
        )
    finally:
        for handle in made:
            await provider.close(handle)
        await provider.aclose()


if __name__ == "__main__":
    forks, files, size = ([int(argument) for argument in sys.argv[1:4]] + [8, 10000, 20000][len(sys.argv[1:4]) :])[:3]
    anyio.run(main, forks, files, size)
