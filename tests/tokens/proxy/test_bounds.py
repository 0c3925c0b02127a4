"""The proxy bounded under hostility: ``previous_response_id`` state in entries and bytes (no chain
keeps an evicted turn alive), concurrent requests per proxy and per rollout (a queue, then a 429
in the client's dialect), and the working memory of one request against its body."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import TaskGroup

from tokens.proxy import create_app
from tokens.proxy._server import listen
from tokens.records import open_store

from .test_hostile import call, exchange

ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
            "token_ids": [7],
            "logprobs": {"content": [{"token": "token_id:7", "logprob": -0.5}]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


class Canned(httpx.AsyncBaseTransport):
    """An upstream that answers every chat completion with one short captured answer, whatever it is
    asked (no tokenizer: a huge prompt costs the upstream nothing here), and keeps the size of each
    request body it was sent."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sizes.append(len(await request.aread()))
        return httpx.Response(200, json=ANSWER)


def app_of(transport: httpx.AsyncBaseTransport, **options: Any) -> Any:
    return create_app("http://upstream.internal:9/v1", transport=transport, responses_upstream="chat", **options)


async def respond(app: Any, body: dict[str, Any], path: str = "/v1/responses") -> tuple[int, dict[str, Any]]:
    status, parts = await call(app, path, body)
    return status, json.loads(b"".join(parts))


# -- previous_response_id ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_chain_longer_than_the_turns_kept_pins_nothing_and_is_a_404() -> None:
    """40 chained 1 MiB turns with 4 turns kept: each turn used to keep the whole chain before it
    (+40 MiB after 40 turns); now a turn keeps only itself, the chain is served while its turns are
    kept, and the continuation of an evicted one is a 404 saying to send the conversation."""
    transport = Canned()
    app = app_of(transport, previous_responses=4)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        previous, statuses = None, []
        for _ in range(40):
            body: dict[str, Any] = {"model": "tiny", "input": [{"role": "user", "content": "x" * 2**20}]}
            if previous is not None:
                body["previous_response_id"] = previous
            status, answer = await respond(app, body)
            statuses.append(status)
            previous = answer.get("id", previous)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        await app.state.proxy.aclose()
    assert statuses[:5] == [200] * 5 and transport.sizes[4] > 5 * 2**20  # turn 5 carried turns 1-4 upstream
    assert (
        set(statuses[5:]) == {404}
        and "no longer kept" in answer["error"]["message"]
        and "whole conversation" in str(answer)
    )
    assert held < 8 * 2**20, f"{held:,} bytes held after the chain"


@pytest.mark.anyio
async def test_the_turns_kept_are_bounded_in_bytes_and_hold_no_echoed_bundle() -> None:
    """At most ``previous_bytes`` together, the least recently used turn evicted first; an input item
    that echoes an earlier answer's bundle is kept without it (it is never sent upstream either)."""
    app = app_of(Canned(), previous_bytes=3 * 2**20)
    kept = app.state.proxy.dialects["responses"].previous
    try:
        ids = []
        for _ in range(6):
            status, answer = await respond(app, {"model": "tiny", "input": "y" * 2**20})
            assert status == 200
            ids.append(answer["id"])
        assert len(kept._turns) == 2 and kept.bytes <= 3 * 2**20
        assert (await respond(app, {"model": "tiny", "input": "z", "previous_response_id": ids[0]}))[0] == 404
        echoed = {"type": "message", "role": "assistant", "content": "ok", "prompt_token_ids": list(range(200_000))}
        status, answer = await respond(app, {"model": "tiny", "input": [echoed, {"role": "user", "content": "q"}]})
        assert status == 200 and len(kept._turns[answer["id"]].items) < 1_000
        status, follow = await respond(app, {"model": "tiny", "input": "again", "previous_response_id": answer["id"]})
        assert status == 200 and follow["output"][-1]["generation_token_ids"] == [7]
    finally:
        await app.state.proxy.aclose()


@pytest.mark.anyio
async def test_with_a_store_the_bounds_are_the_store_s(tmp_path: Path) -> None:
    """With a record store the turns live there, bounded there (``previous_responses`` for every proxy
    over the store together): a third turn evicts the first, whose continuation is a 404, while the
    latest chain is served."""
    store = open_store(f"sqlite:///{tmp_path / 'records.db'}")
    app = app_of(Canned(), store=store, previous_responses=2)
    try:
        ids = []
        for _ in range(3):
            status, answer = await respond(app, {"model": "tiny", "input": "q"})
            assert status == 200
            ids.append(answer["id"])
        rows = await store._run(lambda cursor: cursor.execute("SELECT response_id FROM token_responses"), "ids")
        assert sorted(row[0] for row in rows) == sorted(ids[1:])
        assert (await respond(app, {"model": "tiny", "input": "z", "previous_response_id": ids[0]}))[0] == 404
        assert (await respond(app, {"model": "tiny", "input": "z", "previous_response_id": ids[2]}))[0] == 200
    finally:
        await app.state.proxy.aclose()
        await store.close()


# -- requests at once ----------------------------------------------------------------------------


class Held(Canned):
    """An upstream that answers only once ``release`` is set; ``arrived`` counts requests it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sizes.append(len(await request.aread()))
        await self.release.wait()
        return httpx.Response(200, json=ANSWER)


async def answered(app: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """The status, headers and JSON body of one request to the ASGI ``app``."""
    out = await exchange(app, path, body)
    headers = {name.decode(): value.decode() for name, value in out[0]["headers"]}
    return out[0]["status"], headers, json.loads(b"".join(m["body"] for m in out[1:]))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_requests_past_the_proxys_places_wait_in_a_bounded_queue_then_get_a_429(anyio_backend: str) -> None:
    """Two places and room for one waiting: a third request waits (its body not read), a fourth is a
    429 at once, with Retry-After and in its dialect's shape; once the two end, the third is served."""
    transport = Held()
    app = app_of(transport, max_requests=2, max_queued=1)
    results: list[tuple[int, dict[str, str], dict[str, Any]]] = []
    try:
        async with anyio.create_task_group() as group:

            async def one(path: str, body: dict[str, Any]) -> None:
                results.append(await answered(app, path, body))

            for _ in range(3):
                group.start_soon(one, "/v1/chat/completions", CHAT)
            with anyio.fail_after(10):
                while len(transport.sizes) < 2 or app.state.proxy.intake.admission.waiting < 1:
                    await anyio.sleep(0.01)
            status, headers, body = await answered(app, "/v1/messages", MESSAGES)
            assert status == 429 and headers["retry-after"] == "1"
            assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
            assert "the proxy serves 2 requests at once and 1 more are waiting" in body["error"]["message"]
            assert len(transport.sizes) == 2  # the waiting one was not sent upstream
            transport.release.set()
    finally:
        await app.state.proxy.aclose()
    assert [status for status, _, _ in results] == [200, 200, 200]
    assert app.state.proxy.intake.admission.waiting == 0 and not app.state.proxy.intake.admission._rollouts


@asynccontextmanager
async def rollout_a_held(queue_timeout: float) -> AsyncIterator[tuple[Any, Held, TaskGroup]]:
    """An app with one place per rollout, rollout a's taken by a model call the upstream holds (released
    as the block ends), and the task group it runs in."""
    transport = Held()
    app = app_of(transport, max_rollout_requests=1, queue_timeout=queue_timeout)
    try:
        async with anyio.create_task_group() as group:
            try:
                group.start_soon(answered, app, "/r/a/v1/chat/completions", CHAT)
                with anyio.fail_after(10):
                    while not transport.sizes:
                        await anyio.sleep(0.01)
                yield app, transport, group
            finally:
                transport.release.set()
    finally:
        await app.state.proxy.aclose()


@pytest.mark.anyio
async def test_a_rollout_has_its_own_places_and_a_wait_past_queue_timeout_is_a_429() -> None:
    """One place per rollout: rollout a's second request waits, then is a 429 in the OpenAI shape
    after queue_timeout; rollout b is served meanwhile."""
    async with rollout_a_held(queue_timeout=0.3) as (app, transport, group):
        status, headers, body = await answered(app, "/r/a/v1/chat/completions", CHAT)
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "rate_limit_exceeded" and "queue_timeout=0.3 s" in body["error"]["message"]
        assert "rollout 'a' serves 1 requests at once" in body["error"]["message"]
        group.start_soon(answered, app, "/r/b/v1/chat/completions", CHAT)
        with anyio.fail_after(10):  # b reaches the upstream while a's first request holds a's place
            while len(transport.sizes) < 2:
                await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_the_side_routes_that_ask_an_upstream_take_a_place_too() -> None:
    """Rollout a's one place held by a model call: its legacy completion and its token count wait, then
    are 429s; a probe of its base URL, which asks no upstream, is answered at once."""
    async with rollout_a_held(queue_timeout=0.2) as (app, transport, _):
        status, headers, body = await answered(app, "/r/a/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert status == 429 and "retry-after" in headers and body["error"]["type"] == "rate_limit_exceeded"
        status, _, body = await answered(app, "/r/a/v1/messages/count_tokens", MESSAGES)
        assert status == 429 and body["error"]["type"] == "rate_limit_error"  # in the Messages shape
        status, _, _ = await answered(app, "/r/a/v1", {})  # the base URL (a 404 for POST): no place needed
        assert status == 404
        assert len(transport.sizes) == 1  # neither refused route reached the upstream
    assert not app.state.proxy.intake.admission._rollouts


# -- one request's working memory ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/r/r1/v1/chat/completions"])
async def test_a_request_costs_a_small_multiple_of_its_body(path: str) -> None:
    """A 6 MiB conversation of many short messages: the proxy's peak is under 7x its body, this
    test's own copies of it (its JSON text and bytes, 2x) included. The body used to be read as parts
    and joined, then encoded, decoded again and re-encoded by the capture transport (about 10.6x)."""
    messages = [{"role": "user" if i % 2 else "assistant", "content": "hello there " * 4} for i in range(80_000)]
    body = {"model": "tiny", "messages": messages}
    size = len(json.dumps(body))
    app = app_of(Canned())
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        status, _ = await call(app, path, body)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        await app.state.proxy.aclose()
    assert status == 200
    assert peak < 7 * size, f"peak {peak / size:.1f}x the body"


# -- the first event's latency ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_proxys_connections_send_each_write_at_once(anyio_backend: str) -> None:
    """The socket the proxy serves on gives connections with TCP_NODELAY (asyncio sets it on those of
    an IPPROTO_TCP socket only): without it, a stream's first event, written after its headers, waited
    for the client's delayed ACK, 40 ms added to the time to the first event."""
    sock = listen("127.0.0.1", 0)
    delays: list[int] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        delays.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        with anyio.fail_after(10):
            while not delays:
                await anyio.sleep(0.01)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert delays == [1]
