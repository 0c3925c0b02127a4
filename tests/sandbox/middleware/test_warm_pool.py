"""``WarmPoolMiddleware``: ready sandboxes handed out at once, telemetry that stays true, recycling by age,
refills within admission, a drained ``aclose``, and a crashed pool's sandboxes found by ``reap --run``."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_middleware import (
    INTERCHANGEABLE_FIELDS,
    AdmissionMiddleware,
    DockerProvider,
    LocalProvider,
    Middleware,
    OwnershipMiddleware,
    ProviderMiddleware,
    Sandbox,
    SandboxArgumentError,
    SandboxError,
    SandboxHandle,
    SandboxSnapshot,
    SandboxSnapshotNotFoundError,
    SandboxSpec,
    SupportsSandboxSnapshot,
    WarmPoolMiddleware,
    recommended_middleware,
    stack,
)
from sandbox_middleware.middleware._warm_pool import spec_key
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests import ROOT
from tests.providers import PlainProvider

from ..cli.test_cli import CLI
from .admission.test_admission import RateLimitedProvider, most_in_one_second

pytestmark = pytest.mark.anyio

OWNED = {"sandbox_middleware.run_id": "pooled"}


class SlowStart(ProviderMiddleware):
    """A scripted provider start: every create takes ``start_s`` more (a remote provider's minute, shortened)."""

    def __init__(self, inner: Any, *, start_s: float) -> None:
        super().__init__(inner)
        self.start_s = start_s

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        await anyio.sleep(self.start_s)
        return await self.inner.create(spec, **extensions)


def pooled_stack(provider: Any, telemetry: TelemetryCapture, **pool: Any) -> Any:
    """The recommended stack with a warm pool and admission, over ``provider``."""
    return stack(
        provider,
        recommended_middleware(
            meter_provider=telemetry.meter_provider,
            tracer_provider=telemetry.tracer_provider,
            warm_pool=pool,
            admission={},
        ),
    )


def layer(provider: Any, cls: type) -> Any:
    while not isinstance(provider, cls):
        provider = provider.inner
    return provider


async def handouts_while_ahead(
    provider: Any, pool: WarmPoolMiddleware, spec: SandboxSpec | None = None
) -> list[SandboxHandle]:
    """Fill the pool of 8, then take 8 sandboxes one at a time (how fast a hand-out is, bench/warm_pool.py
    measures; a test asserts that each was a hit: a ready sandbox, no start waited for)."""
    await pool.wait_ready(timeout_s=60)
    return [await provider.create(spec or SandboxSpec()) for _ in range(8)]


async def test_a_pool_of_8_hands_out_at_once_and_telemetry_stays_true(telemetry: TelemetryCapture) -> None:
    """A 500 ms start: hand-outs from a pool ahead of demand are all hits; every pooled
    sandbox counts in gym.sandbox.active; the provider's starts stay in startup_duration_ms."""
    inner = FaultInjectingProvider(latency={"create": 0.5})
    provider = pooled_stack(inner, telemetry, size=8, specs=[SandboxSpec()])
    pool = layer(provider, WarmPoolMiddleware)
    handles = await handouts_while_ahead(provider, pool)
    assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == 8
    assert telemetry.histogram_count("gym.sandbox.pool.handout_duration_ms", result="hit") == 8
    # Pooled sandboxes exist and cost money: active counts them beside the 8 handed out.
    assert telemetry.value("gym.sandbox.active") == len(inner.alive) == 8 + pool.ready()
    assert telemetry.value("gym.sandbox.pool.ready") == pool.ready()
    for handle in handles:
        await provider.close(handle)
    await pool.wait_ready(timeout_s=30)
    assert telemetry.histogram_count("gym.sandbox.startup_duration_ms") == 16  # the provider's starts, refills too
    await provider.aclose()
    assert inner.alive == set() and telemetry.value("gym.sandbox.active") == 0
    assert telemetry.value("gym.sandbox.pool.recycled_total", reason="drain") == 8
    assert telemetry.value("gym.sandbox.pool.ready") == 0


async def test_a_pool_on_the_local_provider(telemetry: TelemetryCapture, sandbox_base: Path) -> None:
    """The same on real local sandboxes with a scripted 500 ms start; a handed-out sandbox runs commands."""
    local = LocalProvider(isolation="none", base_dir=sandbox_base)
    provider = pooled_stack(SlowStart(local, start_s=0.5), telemetry, size=8, specs=[SandboxSpec()])
    handles = await handouts_while_ahead(provider, layer(provider, WarmPoolMiddleware))
    assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == 8
    assert (await provider.exec(handles[0], "echo warm")).stdout == "warm\n"
    for handle in handles:
        await provider.close(handle)
    await provider.aclose()
    assert await local.list() == []


async def test_a_pool_on_the_docker_provider(telemetry: TelemetryCapture) -> None:
    """The same on real containers (the shared dockerd; every container carries this session's label)."""
    from ..providers.docker._support import containers, remove_containers, require_docker
    from ..providers.docker._support import spec as docker_spec

    require_docker()
    docker = DockerProvider()
    spec = docker_spec()
    provider = pooled_stack(SlowStart(docker, start_s=0.5), telemetry, size=8, specs=[spec])
    try:
        handles = await handouts_while_ahead(provider, layer(provider, WarmPoolMiddleware), spec)
        assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == 8
        assert (await provider.exec(handles[0], "echo warm")).stdout == "warm\n"
        for handle in handles:
            await provider.close(handle)
        await provider.aclose()
        assert telemetry.value("gym.sandbox.active") == 0
        assert containers() == []
    finally:
        remove_containers()


async def test_a_miss_creates_normally_and_starts_its_own_pool(telemetry: TelemetryCapture) -> None:
    inner = FaultInjectingProvider(latency={"create": 0.05})
    provider = pooled_stack(inner, telemetry, size=2)
    pool = layer(provider, WarmPoolMiddleware)
    first = await provider.create(SandboxSpec(image="python:3.12"))  # no pool yet for this key: a miss
    assert telemetry.value("gym.sandbox.pool.handout_total", result="miss") == 1
    await pool.wait_ready(timeout_s=10)
    # files are written after the hand-out, so they do not matter; the image does
    hit = await provider.create(SandboxSpec(image="python:3.12", files={"a.txt": "x"}))
    other = await provider.create(SandboxSpec(image="python:3.13"))
    assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == 1
    assert telemetry.value("gym.sandbox.pool.handout_total", result="miss") == 2
    for handle in (first, hit, other):
        await provider.close(handle)
    await provider.aclose()
    assert inner.alive == set()


def test_which_fields_make_sandboxes_interchangeable() -> None:
    base = SandboxSpec(image="img", env={"A": "1", "B": "2"}, resources={"cpu": 1})
    assert spec_key(base) == spec_key(SandboxSpec(image="img", env={"B": "2", "A": "1"}, resources={"cpu": 1.0}))
    assert spec_key(base) == spec_key(dataclasses.replace(base, files={"x": "y"}, ready_timeout_s=5))
    for name, value in [
        ("image", "other"),
        ("env", {"A": "9"}),
        ("resources", {"cpu": 2}),
        ("workdir", "/w"),
        ("entrypoint", ["sh"]),
        ("ports", [8080]),
        ("ttl_s", 60),
        ("metadata", {"task": "7"}),
        ("provider_options", {"gpu": True}),
    ]:
        assert name in INTERCHANGEABLE_FIELDS
        assert spec_key(base) != spec_key(dataclasses.replace(base, **{name: value})), name


async def test_old_sandboxes_are_recycled(telemetry: TelemetryCapture) -> None:
    inner = FaultInjectingProvider(latency={"create": 0.02})
    provider = pooled_stack(inner, telemetry, size=2, max_age_s=0.3, specs=[SandboxSpec()])
    pool = layer(provider, WarmPoolMiddleware)
    await pool.wait_ready(timeout_s=10)
    first_ids = {handle.sandbox_id for _, handle in next(iter(pool._pools.values())).ready}
    await anyio.sleep(0.5)
    await pool.wait_ready(timeout_s=10)
    handle = await provider.create(SandboxSpec())
    assert handle.sandbox_id not in first_ids
    assert telemetry.value("gym.sandbox.pool.recycled_total", reason="max_age") >= 2
    assert not first_ids & inner.alive  # the old ones were closed, not leaked
    await provider.close(handle)
    await provider.aclose()
    assert inner.alive == set()


async def test_refills_stay_within_the_admission_limits(telemetry: TelemetryCapture) -> None:
    """Refills go through admission: a pool of 40 behind a limit of 20 creates/s, a held cap of 30."""
    inner = RateLimitedProvider(limit=21)
    provider = pooled_stack(inner, telemetry, size=40, specs=[SandboxSpec()])
    admission = layer(provider, AdmissionMiddleware)
    admission.max_create_rate, admission.max_held = 20, 30
    pool = layer(provider, WarmPoolMiddleware)
    pool._start()
    with anyio.move_on_after(2.0):
        await pool.wait_ready()
    assert inner.refused == [] and most_in_one_second(inner.seen) <= 21
    assert 20 <= len(inner.alive) <= 30  # the held cap counts pooled sandboxes
    await provider.aclose()
    assert inner.alive == set() and admission.held_slots() == 0


def test_bad_options_are_refused_in_words() -> None:
    with pytest.raises(SandboxArgumentError, match="size must be >= 1"):
        WarmPoolMiddleware(FaultInjectingProvider(), size=0)
    with pytest.raises(SandboxArgumentError, match="max_age_s must be > 0"):
        WarmPoolMiddleware(FaultInjectingProvider(), size=1, max_age_s=0)


# -- a crashed pool process, reaped ----------------------------------------------------------------

POOL_PROCESS = """
import sys, anyio
from pathlib import Path
from sandbox_middleware import *

async def main(base, run_id):
    provider = stack(LocalProvider(isolation="none", base_dir=Path(base)), [
        Middleware(WarmPoolMiddleware, size=4, specs=[SandboxSpec()]),
        Middleware(ReleaseAccountingMiddleware), Middleware(AdmissionMiddleware),
        Middleware(OwnershipMiddleware, run_id=run_id),
    ])
    await provider.wait_ready(timeout_s=60)
    print("ready", flush=True)
    await anyio.sleep_forever()

anyio.run(main, sys.argv[1], sys.argv[2])
"""


def _listed(base: Path) -> list[Any]:
    async def listed() -> list[Any]:
        provider = LocalProvider(isolation="none", base_dir=base)
        try:
            return await provider.list()
        finally:
            await provider.aclose()  # leaves what it only listed

    return anyio.run(listed)


def test_a_crashed_pools_sandboxes_are_reaped_by_run(tmp_path: Path, sandbox_base: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", POOL_PROCESS, str(sandbox_base), "crashed-pool"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
    listed = _listed(sandbox_base)
    assert len(listed) == 4 and {item.metadata["sandbox_middleware.run_id"] for item in listed} == {"crashed-pool"}
    config = tmp_path / "stack.yaml"
    config.write_text(f'provider: {{local: {{isolation: none, base_dir: "{sandbox_base}"}}}}\n')
    reaped = subprocess.run(
        [*CLI, "reap", str(config), "--run", "crashed-pool"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert reaped.returncode == 0, reaped.stderr
    assert {line.split()[0] for line in reaped.stdout.splitlines()} == {item.handle.sandbox_id for item in listed}
    assert _listed(sandbox_base) == []


async def test_two_callers_of_wait_ready_both_return() -> None:
    """Each waiter made its own event and the first waiter's was replaced: it waited for ever."""
    inner = FaultInjectingProvider(latency={"create": 0.05})
    pool = WarmPoolMiddleware(inner, size=4, specs=[SandboxSpec()])
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(pool.wait_ready)
    assert pool.ready() == 4
    await pool.aclose()
    assert inner.alive == set()


async def test_a_new_key_after_the_refill_task_went_idle_starts_its_pool(telemetry: TelemetryCapture) -> None:
    """Nothing woke the idle refill task for a new key: its pool never started, contrary to the docs."""
    inner = FaultInjectingProvider(latency={"create": 0.02})
    provider = pooled_stack(inner, telemetry, size=2, specs=[SandboxSpec(image="python:3.12")])
    pool = layer(provider, WarmPoolMiddleware)
    await pool.wait_ready(timeout_s=10)  # the 3.12 pool is full: the refill task waits for a wake-up
    await anyio.sleep(0.1)
    miss = await provider.create(SandboxSpec(image="python:3.13"))
    with anyio.fail_after(10):
        while pool.ready() < 4:
            await anyio.sleep(0.01)
    hit = await provider.create(SandboxSpec(image="python:3.13"))
    assert telemetry.value("gym.sandbox.pool.handout_total", result="miss") == 1
    assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == 1
    for handle in (miss, hit):
        await provider.close(handle)
    await provider.aclose()
    assert inner.alive == set()


# -- pools of forks ----------------------------------------------------------------------------------


class SlowReturn(ProviderMiddleware):
    """A create whose response takes ``return_s`` to come back once the sandbox is made."""

    def __init__(self, inner: Any, *, return_s: float) -> None:
        super().__init__(inner)
        self.return_s = return_s

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        handle = await self.inner.create(spec, **extensions)
        await anyio.sleep(self.return_s)
        return handle


def forking_stack(inner: Any, telemetry: TelemetryCapture, **pool: Any) -> Any:
    """The recommended stack with a warm pool and admission, and an ownership layer under them."""
    middleware = recommended_middleware(
        meter_provider=telemetry.meter_provider,
        tracer_provider=telemetry.tracer_provider,
        warm_pool=pool,
        admission={},
    )
    return stack(inner, [*middleware, Middleware(OwnershipMiddleware, run_id="pooled")])


async def prepared(provider: Any, tmp_path: Path, text: str) -> SandboxSnapshot:
    """A snapshot of a sandbox whose state.txt holds ``text``; the sandbox is closed after."""
    (tmp_path / "state").write_text(text)
    async with Sandbox(provider, local_files={"state.txt": tmp_path / "state"}) as parent:
        snapshot: SandboxSnapshot = await parent.snapshot()
    return snapshot


async def state_of(provider: Any, handle: SandboxHandle, tmp_path: Path) -> str | None:
    try:
        await provider.download_file(handle, "state.txt", tmp_path / "got")
    except SandboxError:
        return None
    return (tmp_path / "got").read_text()


async def test_forks_are_pooled_per_spec_and_snapshot(telemetry: TelemetryCapture, tmp_path: Path) -> None:
    """A pooled fork is handed out for its own snapshot only: never for another one, for a create without
    one, or for an altered descriptor; the stamp of the ownership layer below does not split the pool."""
    inner = FaultInjectingProvider()
    provider = forking_stack(inner, telemetry, size=2)
    pool = layer(provider, WarmPoolMiddleware)
    first, second = await prepared(provider, tmp_path, "first"), await prepared(provider, tmp_path, "second")
    spec = SandboxSpec(env={"ROLE": "fork"})  # not the parents' spec (their pool is of empty sandboxes)
    miss = await provider.create(spec, from_snapshot=first)  # starts the pool of (spec, first)
    other = await provider.create(spec, from_snapshot=second)
    plain = await provider.create(spec)
    await pool.wait_ready(timeout_s=10)
    hits = telemetry.value("gym.sandbox.pool.handout_total", result="hit")
    forks = [await provider.create(spec, from_snapshot=snapshot) for snapshot in (first, second, first)]
    assert telemetry.value("gym.sandbox.pool.handout_total", result="hit") == hits + 3
    assert [await state_of(provider, handle, tmp_path) for handle in (miss, *forks)] == [
        "first",
        "first",
        "second",
        "first",
    ]
    empty = await provider.create(spec)
    assert await state_of(provider, plain, tmp_path) is None and await state_of(provider, empty, tmp_path) is None
    altered = dataclasses.replace(first, metadata={**first.metadata, "sandbox_middleware.owner.pid": "1"})
    with pytest.raises(SandboxSnapshotNotFoundError):  # not the pool's descriptor: the provider refuses it
        await provider.create(spec, from_snapshot=altered)
    await pool.wait_ready(timeout_s=10)  # the hits' refills landed
    # Forks were stamped, counted held and timed as starts below the pool, refills too.
    stamped = {listing.handle.sandbox_id for listing in await inner.list(metadata=OWNED)}
    assert stamped == inner.alive and telemetry.value("gym.sandbox.active") == len(inner.alive)
    # the two misses, then each pool's two refills and the refills of the three hits
    assert telemetry.value("gym.sandbox.snapshot.fork_total") == 2 + 4 + 3
    for handle in (miss, other, *forks, plain, empty):
        await provider.close(handle)
    for snapshot in (first, second):
        await provider.delete_snapshot(snapshot)
    await provider.aclose()
    assert inner.alive == set() and inner.snapshots == set()


async def test_deleting_a_snapshot_drains_its_pool(telemetry: TelemetryCapture, tmp_path: Path) -> None:
    """Its ready forks are closed, a refill in flight is closed as it lands, no refill starts again, the
    other pools stay; a create from it is then refused by the provider."""
    inner = FaultInjectingProvider()
    provider = forking_stack(SlowReturn(inner, return_s=0.2), telemetry, size=3)
    pool = layer(provider, WarmPoolMiddleware)
    doomed, kept = await prepared(provider, tmp_path, "doomed"), await prepared(provider, tmp_path, "kept")
    held = [await provider.create(SandboxSpec(), from_snapshot=snapshot) for snapshot in (doomed, kept)]
    await pool.wait_ready(timeout_s=10)
    take = await provider.create(SandboxSpec(), from_snapshot=doomed)  # a refill of its pool starts
    await anyio.sleep(0.05)  # the refill's fork is made; its handle is on its way back
    await provider.delete_snapshot(doomed)
    assert pool.ready() == 6  # those of the other snapshot and of the parents' (empty) spec
    await anyio.sleep(0.3)  # the refill in flight lands, and is closed
    creates = inner.calls["create"]
    await anyio.sleep(0.3)
    assert inner.calls["create"] == creates and pool.ready() == 6
    assert telemetry.value("gym.sandbox.pool.recycled_total", reason="snapshot_deleted") == 3
    assert len(inner.alive) == 6 + len(held) + 1
    with pytest.raises(SandboxSnapshotNotFoundError):
        await provider.create(SandboxSpec(), from_snapshot=doomed)
    assert await state_of(provider, take, tmp_path) == "doomed"  # a fork handed out is the caller's
    for handle in (*held, take):
        await provider.close(handle)
    await provider.delete_snapshot(kept)
    await provider.aclose()
    assert inner.alive == set()


async def test_a_fork_group_passes_the_pool(telemetry: TelemetryCapture) -> None:
    """``Sandbox.fork``'s creates go through the pool to admission as one group: they start no pool of
    forks and wait for no refill. They started one: 4 more creates, admitted against the same cap
    (waiting for the group's slots; a fork waiting for them would have waited for its own group),
    for a snapshot deleted once the forks are made."""
    inner = FaultInjectingProvider(latency={"create": 0.05})
    provider = stack(
        inner,
        recommended_middleware(
            meter_provider=telemetry.meter_provider, warm_pool={"size": 4}, admission={"max_held": 1 + 4 + 4}
        ),
    )
    pool = layer(provider, WarmPoolMiddleware)
    try:
        async with Sandbox(provider, create_timeout_s=10) as parent:
            await pool.wait_ready(timeout_s=10)  # the pool of the parent's spec: 4 held
            with anyio.fail_after(30):
                async with parent.fork(4) as forks:
                    assert len(forks) == 4
            await anyio.sleep(0.5)  # a refill would have been made, or tried
            assert inner.calls["create"] == 1 + 4 + 4 and pool.ready() == 4  # the parent, its pool, the forks
    finally:
        await provider.aclose()
    assert inner.alive == set() and inner.snapshots == set()


async def test_without_the_capability_the_pool_takes_no_snapshot_calls() -> None:
    pool = WarmPoolMiddleware(PlainProvider(), size=1)
    assert not isinstance(pool, SupportsSandboxSnapshot) and pool.delete_snapshot is None  # type: ignore[comparison-overlap]
    await pool.aclose()
