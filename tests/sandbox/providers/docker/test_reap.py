"""reap over DockerProvider's labels: a trainer in a PID namespace of its own (a host-network
container: the host's hostname, pids of its own) keeps its containers against a reap from the host."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable

import pytest

from sandbox_middleware import DockerProvider, reap
from tests.providers import in_own_pid_namespace, live_worker

from ._support import BUSYBOX, SESSION, SESSION_KEY, containers

pytestmark = pytest.mark.anyio

_TRAINER = """
import anyio, sys
from sandbox_middleware import DockerProvider, Middleware, OwnershipMiddleware, SandboxSpec, stack

async def main():
    # No spare: one carries the run's labels too, though it is no sandbox reap lists (test_spares.py)
    provider = stack(DockerProvider(prestart=False), [Middleware(OwnershipMiddleware, run_id=sys.argv[1])])
    for _ in range(3):
        spec = SandboxSpec(image=sys.argv[2], metadata={sys.argv[3]: sys.argv[4]})
        print((await provider.create(spec)).sandbox_id, flush=True)
    await anyio.sleep(600)

anyio.run(main)
"""


async def test_a_trainer_in_its_own_pid_namespace_keeps_its_containers_unless_forced(
    make: Callable[..., DockerProvider],
) -> None:
    run_id = f"ns-run-{uuid.uuid4().hex[:8]}"
    provider = make()
    argv = in_own_pid_namespace([sys.executable, "-c", _TRAINER, run_id, BUSYBOX, SESSION_KEY, SESSION])
    async with live_worker(argv) as made:
        listed = await provider.list(metadata={"sandbox_middleware.run_id": run_id})
        assert {listing.handle.sandbox_id for listing in listed} == made
        assert listed[0].metadata["sandbox_middleware.owner.pidns"] != os.readlink("/proc/self/ns/pid")
        for report in (await reap(provider, dry_run=True), await reap(provider, run_id=run_id)):
            assert report == []
            assert {entry.sandbox_id for entry in report.unknown} >= made  # others' may be listed beside (xdist)
            assert all("PID namespace" in entry.reason for entry in report.unknown if entry.sandbox_id in made)
        label = f"sandbox_middleware.docker.meta.sandbox_middleware.run_id={run_id}"
        assert len(containers(label)) == 3
        forced = await reap(provider, run_id=run_id, force=True)
        assert {entry.sandbox_id for entry in forced} == made and all(entry.closed for entry in forced)
        assert containers(label) == []
