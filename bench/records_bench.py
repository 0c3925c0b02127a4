"""Durable token records: their costs, measured side by side in one run.

Run: python bench/records_bench.py. Prints, at 8,192 prompt + 2,048 generated tokens per call:

1. records per second put into SQLite (one file, WAL, synchronous=FULL: durable on return) and
   PostgreSQL (a cluster of its own on loopback, started with initdb/pg_ctl when the server is
   installed), from one client one at a time and from 8 concurrent callers;
2. the latency per call of ``TokenCaptureTransport`` over the same in-memory server: a plain
   ``httpx`` post + ``json.loads``, capture alone, and capture writing through ``sink=`` into each
   store, for a root turn and for a continuation (its parent resolved by lineage, verified, and
   stored as a delta): the added latency is printed beside the capture's own cost.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.tokens_bench import vllm_response  # noqa: E402
from tests.postgres import fresh_database, postgres_problem, running_postgres  # noqa: E402
from tests.tokens.records.helpers import make_record  # noqa: E402
from tokens import TokenCaptureTransport  # noqa: E402
from tokens.records import open_store  # noqa: E402

PROMPT, GENERATED = 8_192, 2_048
PUTS = 200
CALLS = 60
CHAT = "http://vllm.test:8000/v1/chat/completions"


async def records_per_second(url: str, concurrency: int) -> float:
    prompt = list(range(PROMPT))
    records = [make_record(f"put-{concurrency}-{i % 20}", f"c{i}", prompt, [1] * GENERATED) for i in range(PUTS)]
    async with open_store(url, pool_size=max(concurrency, 1)) as store:
        await store.put(make_record("warm", "w", [1], [2]))
        started = time.perf_counter()
        if concurrency == 1:
            for record in records:
                await store.put(record)
        else:
            async with anyio.create_task_group() as group:
                for lane in range(concurrency):
                    group.start_soon(_put_all, store, records[lane::concurrency])
        return PUTS / (time.perf_counter() - started)


async def _put_all(store: Any, records: list[Any]) -> None:
    for record in records:
        await store.put(record)


def turn_bodies() -> tuple[bytes, bytes, str]:
    """Two vLLM answers: a root turn, and a continuation whose prompt extends it; the root's text."""
    first = json.loads(vllm_response(PROMPT, GENERATED, seed=1))
    cumulative = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    second = json.loads(vllm_response(PROMPT, GENERATED, seed=2))
    second["prompt_token_ids"] = [*cumulative, 5, 6, 7]
    second["usage"]["prompt_tokens"] = len(second["prompt_token_ids"])
    second["usage"]["total_tokens"] = second["usage"]["prompt_tokens"] + GENERATED
    return json.dumps(first).encode(), json.dumps(second).encode(), first["choices"][0]["message"]["content"]


async def per_call_ms(sink: Any) -> tuple[float, float]:
    """Best ms per root turn and per continuation through the transport (``sink=None``: capture alone;
    ``"plain"``: a plain httpx client and json.loads)."""
    first, second, text = turn_bodies()

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, content=second if len(body["messages"]) > 1 else first)

    if sink == "plain":
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    else:
        transport = TokenCaptureTransport(
            httpx.MockTransport(handler), request_prompt_and_generation_token_ids=True, sink=sink
        )
        client = httpx.AsyncClient(transport=transport)
    user = {"role": "user", "content": "q"}
    best_root = best_next = float("inf")
    async with client:
        for call in range(CALLS):
            rollout = {"X-Rollout-Id": f"bench-{id(sink)}-{call}"}

            async def post(messages: list[Any], turn: str, rollout: dict[str, str] = rollout) -> float:
                started = time.perf_counter()
                response = await client.post(
                    CHAT, json={"model": "m", "messages": messages}, headers={**rollout, "X-Model-Call-Id": turn}
                )
                json.loads(response.content)
                return time.perf_counter() - started

            best_root = min(best_root, await post([user], "t0"))
            best_next = min(best_next, await post([user, {"role": "assistant", "content": text}, user], "t1"))
    return best_root * 1000, best_next * 1000


@contextmanager
def stores() -> Iterator[list[tuple[str, str]]]:
    with tempfile.TemporaryDirectory() as folder:
        found = [("SQLite", f"sqlite:///{folder}/records.db")]
        problem = postgres_problem()
        if problem is not None:
            print(f"PostgreSQL skipped: {problem}")
            yield found
            return
        with running_postgres() as cluster, fresh_database(cluster) as url:
            yield [*found, ("PostgreSQL", url)]


async def timed(fn: Callable[[], Awaitable[Any]]) -> Any:
    return await fn()


async def main() -> None:
    print(f"records of {PROMPT:,} prompt + {GENERATED:,} generated tokens")
    with stores() as found:
        print("\n1. records per second (durable when put returns)")
        for name, url in found:
            one = await records_per_second(url, 1)
            many = await records_per_second(url, 8)
            print(f"  {name:<11} {one:8.1f} records/s one at a time   {many:8.1f} records/s from 8 concurrent callers")
        print(f"\n2. per call through TokenCaptureTransport (best of {CALLS})")
        plain_root, plain_next = await per_call_ms("plain")
        capture_root, capture_next = await per_call_ms(None)
        print(f"  plain httpx + json.loads       root {plain_root:6.2f} ms   continuation {plain_next:6.2f} ms")
        print(
            f"  capture alone                  root {capture_root:6.2f} ms   continuation {capture_next:6.2f} ms"
            f"   (capture's own cost: +{capture_root - plain_root:.2f} / +{capture_next - plain_next:.2f} ms)"
        )
        for name, url in found:
            async with open_store(url) as store:
                root, following = await per_call_ms(store)
            print(
                f"  capture + {name:<11} sink   root {root:6.2f} ms   continuation {following:6.2f} ms"
                f"   (the record adds +{root - capture_root:.2f} / +{following - capture_next:.2f} ms, "
                f"{root / capture_root:.2f}x / {following / capture_next:.2f}x of capture alone)"
            )


if __name__ == "__main__":
    anyio.run(main)
