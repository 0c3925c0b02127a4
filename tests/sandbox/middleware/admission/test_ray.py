"""``AdmissionMiddleware(shared="ray")``: two Ray workers share one create rate through the named actor.

Starts its own Ray head on loopback (the fixture of ``tests/sandbox/cli/test_ray.py``); run it under
``flock /work/wt/ray.lock`` on a shared machine. Skipped without ray; REQUIRE_RAY=1 makes that a failure.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from sandbox_middleware import AdmissionMiddleware, SandboxAdmissionError, SandboxSpec
from sandbox_middleware._groups import create_group
from sandbox_middleware.middleware.admission._ledger import Ledger, apply
from sandbox_middleware.middleware.admission._ray import ACTOR_NAMESPACE, actor_name
from sandbox_middleware.testing import FaultInjectingProvider

from ...cli.test_ray import ray_address  # noqa: F401 - the fixture
from .test_admission import most_in_one_second, shared_creates

KEY = "two-ray-workers"


def _share(count: int, rate: float) -> list[float]:
    """Runs in a Ray worker: its share of the creates under the cluster's one limit."""
    return anyio.run(shared_creates, "ray", KEY, None, count, rate)


def test_two_ray_workers_share_one_limit(ray_address: str) -> None:  # noqa: F811 - the fixture
    """Two Ray tasks, 200 creates each at concurrency 100, one limit of 100/s held by one actor: never
    more than 101 in any second across both (they run on one host: time.monotonic is one clock)."""
    import ray

    ray.init(address=ray_address, logging_level="WARNING")
    try:
        task = ray.remote(num_cpus=1)(_share)
        both = ray.get([task.remote(200, 100) for _ in range(2)], timeout=180)
        ray.kill(ray.get_actor(actor_name(KEY), namespace=ACTOR_NAMESPACE))
    finally:
        ray.shutdown()
    seen = [t for part in both for t in part]
    assert len(seen) == 400
    assert most_in_one_second(seen) <= 101
    assert min(max(part) for part in both) > max(min(part) for part in both)  # they really overlapped


class _OlderLedgerActor:
    """The key's actor as a version before ``acquire_many`` made it (detached, it outlived that job)."""

    def __init__(self) -> None:
        self.ledger = Ledger()

    def call(self, operation: str, args: tuple[Any, ...]) -> Any:
        if operation == "acquire_many":
            raise AttributeError(f"'Ledger' object has no attribute {operation!r}")
        return apply(self.ledger, operation, args)


async def _creates_through(key: str) -> None:
    provider = AdmissionMiddleware(FaultInjectingProvider(), max_held=4, shared="ray", shared_key=key)
    try:
        await provider.close(await provider.create(SandboxSpec()))  # one slot: the operation it knows
        with pytest.raises(
            SandboxAdmissionError, match=r"(?s)acquire_many: .*older version .*ray\.kill\(ray\.get_actor"
        ):
            async with create_group(2, 5.0):
                await provider.create(SandboxSpec())  # a group's slots at once: refused by name, in words
    finally:
        await provider.aclose()


def test_an_actor_of_an_older_version_refuses_a_group_in_words(ray_address: str) -> None:  # noqa: F811
    import ray

    key = "older-actor"
    ray.init(address=ray_address, logging_level="WARNING")
    try:
        actor = ray.remote(num_cpus=0)(_OlderLedgerActor)
        older = actor.options(name=actor_name(key), namespace=ACTOR_NAMESPACE, lifetime="detached").remote()
        try:
            anyio.run(_creates_through, key)
        finally:
            ray.kill(older)
    finally:
        ray.shutdown()
