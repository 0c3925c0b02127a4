"""Rollout throughput with and without a warm pool: the `run` workload, a scripted 1 s provider start.

Run: python bench/warm_pool.py [--provider scripted|local] [--sessions 200] [--concurrency 32]
                              [--pool 96] [--think 0.1]

Both runs use the same stack (the recommended one with admission, ownership innermost) and the
workload of ``sandbox-middleware run`` (each session starts a sandbox, uploads a file, runs 3
commands thinking ``--think`` seconds after each, downloads the result, stops). The provider:
``scripted`` (default), the fault injector's in-process sandboxes with a 1 s start and 50 ms per
command, as a remote provider would answer (its start takes a minute in production); ``local``, a
real ``LocalProvider`` (isolation none) whose every create first waits 1 s (on 2 cores its own
commands, not the starts, then bound the throughput). The only difference between the two runs: a
``warm_pool`` layer of ``--pool`` sandboxes, placed as the recommended stack places it.
Printed side by side: the time to finish every session, sessions per second, and the ratio.
Goal: the pool cuts the time by at least 2x at 200 sessions, concurrency 32.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from sandbox_middleware import (
    LocalProvider,
    Middleware,
    OwnershipMiddleware,
    ProviderMiddleware,
    SandboxHandle,
    SandboxSpec,
    recommended_middleware,
    stack,
)
from sandbox_middleware.cli._workload import RunState, workload
from sandbox_middleware.testing import FaultInjectingProvider

START_S = 1.0


class ScriptedStart(ProviderMiddleware):
    """Every create waits ``START_S`` first: a remote provider's start, shortened."""

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        await anyio.sleep(START_S)
        return await self.inner.create(spec, **extensions)


def run(
    kind: str, base: Path, sessions: int, concurrency: int, think: float, pool: int | None
) -> tuple[float, RunState]:
    warm_pool = None if pool is None else {"size": pool}
    inner: Any = (
        ScriptedStart(LocalProvider(isolation="none", base_dir=base))
        if kind == "local"
        else FaultInjectingProvider(latency={"create": START_S, "exec": 0.05})
    )
    provider = stack(
        inner,
        [*recommended_middleware(admission={}, warm_pool=warm_pool), Middleware(OwnershipMiddleware)],
    )
    state = RunState(sessions)
    started = time.perf_counter()
    anyio.run(lambda: workload(provider, state, concurrency=concurrency, commands=3, think_s=think))
    return time.perf_counter() - started, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["scripted", "local"], default="scripted")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pool", type=int, default=96)
    parser.add_argument("--think", type=float, default=0.1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-warm-pool-") as tmp:
        base = Path(tmp) / "boxes"
        cold, cold_state = run(args.provider, base, args.sessions, args.concurrency, args.think, None)
        warm, warm_state = run(args.provider, base, args.sessions, args.concurrency, args.think, args.pool)
    assert cold_state.ok == warm_state.ok == args.sessions, (cold_state, warm_state)
    print(
        f"`run` workload, {args.provider} provider: {args.sessions} sessions, concurrency {args.concurrency}, "
        f"3 commands, think {args.think:g} s, provider start {START_S:g} s"
    )
    print(f"  without a pool:        {cold:6.2f} s  ({args.sessions / cold:5.1f} sessions/s)")
    print(f"  with a pool of {args.pool:<4}   {warm:6.2f} s  ({args.sessions / warm:5.1f} sessions/s)")
    print(f"  the pool cuts the time {cold / warm:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
