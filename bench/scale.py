"""Scale: 100, 1,000 and 10,000 concurrent sandboxes through the full stack on an in-process provider.

Run: python bench/scale.py (``--held`` for the held-sandboxes figure alone)

For each level, all sandboxes are created concurrently, each runs one exec while all are held, and
all are closed; it prints the time per operation of each phase (the goal is flat: the stack's
bookkeeping is O(1) per sandbox), beside the same phases on the bare provider in the same run
(what the event loop and the garbage collector cost at that scale without any middleware) and,
from a separate tracemalloc pass, the memory each held sandbox costs across the stack (ledger,
handle, telemetry) with the SDK configured.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import tracemalloc
from typing import Any

import anyio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from sandbox_middleware import (
    SandboxHandle,
    SandboxSpec,
    recommended_middleware,
    stack,
)
from sandbox_middleware.testing import FaultInjectingProvider

LEVELS = (100, 1_000, 10_000)


class DropExporter(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def build(variant: str = "sdk") -> tuple[Any, FaultInjectingProvider, tuple[Any, ...]]:
    """The provider for ``variant``: the stack with an SDK, the stack without one, or the bare provider."""
    inner = FaultInjectingProvider(name="inproc")
    if variant == "bare":
        return inner, inner, ()
    if variant == "no-sdk":
        return stack(inner, recommended_middleware()), inner, ()
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropExporter(), max_queue_size=200_000))
    provider: Any = stack(inner, recommended_middleware(meter_provider=meter_provider, tracer_provider=tracer_provider))
    return provider, inner, (meter_provider, tracer_provider)


async def phase(count: int, operation: Any) -> float:
    """Run ``operation(i)`` for i < count all at once; CPU microseconds of this process per operation
    (other processes on a shared machine do not count; the collector's passes do)."""
    if gc.isenabled():
        gc.collect()
    started = time.process_time()
    async with anyio.create_task_group() as tg:
        for index in range(count):
            tg.start_soon(operation, index)
    return (time.process_time() - started) / count * 1e6


async def level(count: int, variant: str = "sdk") -> tuple[float, float, float]:
    """Best of several runs at this level (about 2,000 sandboxes in all, at least three runs)."""
    runs = [await one_run(count, variant) for _ in range(max(3, 2_000 // count))]
    create_us, exec_us, close_us = (min(run[i] for run in runs) for i in range(3))
    return create_us, exec_us, close_us


async def one_run(count: int, variant: str) -> tuple[float, float, float]:
    provider, inner, providers = build(variant)
    handles: list[SandboxHandle | None] = [None] * count

    async def create(index: int) -> None:
        handles[index] = await provider.create(SandboxSpec())

    async def execute(index: int) -> None:
        handle = handles[index]
        assert handle is not None
        await provider.exec(handle, "true")

    async def close(index: int) -> None:
        handle = handles[index]
        assert handle is not None
        await provider.close(handle)

    create_us = await phase(count, create)
    assert len(inner.alive) == count
    exec_us = await phase(count, execute)
    close_us = await phase(count, close)
    assert not inner.alive
    for telemetry in providers:
        telemetry.shutdown()
    return create_us, exec_us, close_us


async def memory_per_sandbox(count: int) -> float:
    provider, _, providers = build()
    handles = [await provider.create(SandboxSpec())]  # warm up: instruments and caches exist
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    handles += [await provider.create(SandboxSpec()) for _ in range(count)]
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    for handle in handles:
        await provider.close(handle)
    for telemetry in providers:
        telemetry.shutdown()
    return grown / count


async def table(gc_paused: bool) -> None:
    """One timing table; with ``gc_paused`` the cyclic garbage collector is off, which isolates the
    stack's own per-operation cost from the collector's, whose passes grow with the live heap."""
    variants = ("sdk", "no-sdk", "bare")
    print(
        "\nCPU microseconds per operation (create / exec / close), all at once at each level"
        + (", cyclic GC paused" if gc_paused else ", GC on (as deployed)")
    )
    print(f"{'concurrent':>10}  " + "  ".join(f"{LABELS[v]:>22}" for v in variants))
    results: dict[tuple[int, str], tuple[float, float, float]] = {}
    if gc_paused:
        gc.disable()
    try:
        for count in LEVELS:
            cells = []
            for variant in variants:
                results[count, variant] = timing = await level(count, variant)
                cells.append(" / ".join(f"{value:6.1f}" for value in timing))
            print(f"{count:>10}  " + "  ".join(f"{cell:>22}" for cell in cells))
    finally:
        gc.enable()
    names = ("create", "exec", "close")
    for variant in ("sdk", "no-sdk"):
        extra = {
            count: [
                stacked - bare for stacked, bare in zip(results[count, variant], results[count, "bare"], strict=True)
            ]
            for count in LEVELS
        }
        own = "  ".join(
            f"{name} " + " / ".join(f"{extra[count][i]:.1f}" for count in LEVELS) for i, name in enumerate(names)
        )
        print(
            f"{LABELS[variant]:>14}: the stack's own cost (minus the bare provider) at 100 / 1,000 / 10,000 us: {own}"
        )
        if not gc_paused:
            low, high = sum(extra[LEVELS[0]]), sum(extra[LEVELS[-1]])
            ratio = f"{high / low:.2f}x" if low > 0 else "-"
            print(
                f"{'':>14}  create + exec + close at {LEVELS[-1]:,} / at {LEVELS[0]:,}: {high:.1f} / {low:.1f} us = "
                f"{ratio} (goal <= 1.30x)"
            )


LABELS = {"sdk": "stack + SDK", "no-sdk": "stack, no SDK", "bare": "bare provider"}


HELD = (100, 10_000)
BATCH = 100
HELD_ROUNDS = 100


async def held_round(provider: Any, held: list[SandboxHandle]) -> tuple[float, float, float]:
    """One round with ``held`` sandboxes held: BATCH creates, BATCH execs on held ones, BATCH closes
    (of those just created), each batch at once; CPU microseconds per operation of each."""
    fresh: list[SandboxHandle | None] = [None] * BATCH

    async def create(index: int) -> None:
        fresh[index] = await provider.create(SandboxSpec())

    async def execute(index: int) -> None:
        await provider.exec(held[index * len(held) // BATCH], "true")

    async def close(index: int) -> None:
        handle = fresh[index]
        assert handle is not None
        await provider.close(handle)

    timings = []
    for operation in (create, execute, close):
        started = time.process_time()
        async with anyio.create_task_group() as tg:
            for index in range(BATCH):
                tg.start_soon(operation, index)
        timings.append((time.process_time() - started) / BATCH * 1e6)
    return timings[0], timings[1], timings[2]


async def held_table() -> bool:
    """The stack's own cost per operation at 100 and at 10,000 held sandboxes, GC on; whether the goal is met.

    Each round runs on the stack and then on a bare provider holding as many sandboxes; the stack's own
    cost is the difference within a round (so the machine's drift between rounds cancels out), and a
    level's figure is the median over its rounds."""
    print(
        f"\nheld sandboxes, GC on: rounds of {BATCH} creates / execs / closes at once, {HELD_ROUNDS} rounds, "
        "stack and bare provider interleaved (CPU us per operation, median over the rounds)"
    )
    print(f"{'held':>7}  {'variant':>14}  {'stack':>22}  {'bare provider':>22}  {'stack own cost':>22}")
    own: dict[tuple[str, int], float] = {}
    for count in HELD:
        for variant in ("no-sdk", "sdk"):
            stacked, inner, providers = build(variant)
            bare = FaultInjectingProvider(name="inproc")
            held = [await stacked.create(SandboxSpec()) for _ in range(count)]
            bare_held = [await bare.create(SandboxSpec()) for _ in range(count)]
            gc.collect()
            rounds: list[tuple[tuple[float, float, float], tuple[float, float, float]]] = []
            for _ in range(HELD_ROUNDS):
                rounds.append((await held_round(stacked, held), await held_round(bare, bare_held)))
            assert len(inner.alive) == count and len(bare.alive) == count
            medians = [
                [statistics.median(r[side][i] for r in rounds) for i in range(3)] for side in (0, 1)
            ]  # fmt: skip
            differences = [statistics.median(r[0][i] - r[1][i] for r in rounds) for i in range(3)]
            own[variant, count] = statistics.median(sum(r[0]) - sum(r[1]) for r in rounds)
            cells = [" / ".join(f"{v:6.1f}" for v in values) for values in (*medians, differences)]
            print(f"{count:>7}  {LABELS[variant]:>14}  " + "  ".join(f"{cell:>22}" for cell in cells))
            for handle in held:
                await stacked.close(handle)
            for telemetry in providers:
                telemetry.shutdown()
    met = True
    for variant in ("no-sdk", "sdk"):
        low, high = own[variant, HELD[0]], own[variant, HELD[-1]]
        ratio = high / low if low > 0 else float("inf")
        met = met and ratio <= 1.3
        print(
            f"{LABELS[variant]:>14}: own cost of create + exec + close at {HELD[-1]:,} held / at {HELD[0]:,} held: "
            f"{high:.1f} / {low:.1f} us = {ratio:.2f}x (goal <= 1.30x)"
        )
    return met


async def main() -> int:
    if sys.argv[1:] == ["--held"]:
        await held_table()
        return 0
    for gc_paused in (False, True):
        await table(gc_paused)
    per_sandbox = await memory_per_sandbox(10_000)
    print(
        f"memory per held sandbox (whole stack, SDK configured, 10,000 held): {per_sandbox / 1024:.2f} KiB "
        f"({per_sandbox * 10_000 / 2**20:.1f} MiB for 10,000)"
    )
    await held_table()
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
