"""Streaming through the capture proxy, side by side with the upstream's own stream, in one run.

Run: python bench/proxy_stream.py. Three processes, as deployed: an upstream serving vLLM-shaped
chat completion streams (inline ids and logprobs per chunk, served by uvicorn), the proxy started as
``python -m tokens.proxy --upstream ...`` in front of it, and this client. Prints:

1. time to the first event, upstream directly vs through the proxy, per dialect (median of many
   requests; the goal: within a few milliseconds of the upstream's own);
2. per-chunk cost of whole streams of 1K to 32K chunks, directly and through the proxy per dialect,
   and the proxy's added cost per chunk (the goal: flat from 1K to 32K).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
FIRST_EVENT_REQUESTS = 200
SIZES = (1_024, 4_096, 16_384, 32_768)
HEAD = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "bench"}


def stream_bytes(chunks: int) -> bytes:
    """A vLLM 0.32 stream of ``chunks`` tokens with return_token_ids and logprobs (as capture asks)."""
    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    events = [{**HEAD, "prompt_token_ids": list(range(3, 515)), "choices": [opening]}]
    for position in range(chunks):
        token = 1000 + position % 5000
        events.append(
            {
                **HEAD,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": " tok"},
                        "logprobs": {
                            "content": [
                                {
                                    "token": f"token_id:{token}",
                                    "logprob": -1.25,
                                    "bytes": [32, 116, 111, 107],
                                    "top_logprobs": [],
                                }
                            ]
                        },
                        "finish_reason": "length" if position == chunks - 1 else None,
                        "token_ids": [token],
                    }
                ],
            }
        )
    events.append(
        {
            **HEAD,
            "choices": [],
            "usage": {"prompt_tokens": 512, "completion_tokens": chunks, "total_tokens": 512 + chunks},
        }
    )
    body = b"".join(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n" for event in events)
    return body + b"data: [DONE]\n\n"


def upstream_app() -> Any:
    """A raw ASGI app: POST .../chat/completions streams ``max_tokens`` chunks, each its own write."""
    cache: dict[int, list[bytes]] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if not scope["path"].endswith("/chat/completions"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        chunks = int(json.loads(body).get("max_tokens") or 16)
        if chunks not in cache:
            cache[chunks] = [event + b"\n\n" for event in stream_bytes(chunks).split(b"\n\n") if event]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for event in cache[chunks]:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def serve_upstream() -> None:
    import asyncio

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(upstream_app(), host="127.0.0.1", port=0, log_level="warning"))

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110  (uvicorn has no startup event to wait on)
            await asyncio.sleep(0.01)
        print(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", flush=True)
        await task

    asyncio.run(run())


def started(command: list[str], tree: Path = ROOT) -> tuple[subprocess.Popen[str], str]:
    """``command`` started in ``tree`` (its Python packages first on the path), and the URL it printed."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}
    )
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    if not url.startswith("http://"):
        process.kill()
        raise SystemExit(f"{command} did not print its URL")
    return process, url


def request(dialect: str, chunks: int) -> tuple[str, dict[str, Any]]:
    if dialect == "responses":
        return "/responses", {"model": "bench", "input": "hi", "max_output_tokens": chunks, "stream": True}
    if dialect == "messages":
        return "/messages", {
            "model": "bench",
            "max_tokens": chunks,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
    body = {"model": "bench", "max_tokens": chunks, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if dialect == "upstream":
        body.update(logprobs=True, return_token_ids=True, stream_options={"include_usage": True})
    return "/chat/completions", body


def timed(client: httpx.Client, base: str, dialect: str, chunks: int) -> tuple[float, float, int]:
    """Seconds to the first event, seconds for the whole stream, bytes received."""
    path, body = request(dialect, chunks)
    start = time.perf_counter()
    first = 0.0
    size = 0
    with client.stream("POST", base + path, json=body) as answer:
        answer.raise_for_status()
        for piece in answer.iter_raw():
            if not first:
                first = time.perf_counter() - start
            size += len(piece)
    return first, time.perf_counter() - start, size


def main() -> None:
    upstream, upstream_url = started([sys.executable, __file__, "--serve-upstream"])
    proxy, proxy_url = started(
        [sys.executable, "-m", "tokens.proxy", "--upstream", upstream_url + "/v1", "--responses-upstream", "chat"]
    )
    routes = [
        ("upstream", upstream_url + "/v1"),
        *((d, proxy_url + "/r/bench/v1") for d in ("chat", "responses", "messages")),
    ]
    try:
        with httpx.Client(timeout=600) as client:
            for name, base in routes:  # warm both processes up
                timed(client, base, name, 64)
            print(
                f"1. time to the first event, median of {FIRST_EVENT_REQUESTS} requests of 64 chunks, in rounds that "
                "interleave the routes (machine noise hits all alike)"
            )
            firsts: dict[str, list[float]] = {name: [] for name, _ in routes}
            for _ in range(FIRST_EVENT_REQUESTS):
                for name, base in routes:
                    firsts[name].append(timed(client, base, name, 64)[0])
            direct = statistics.median(firsts["upstream"]) * 1000
            for name, _ in routes:
                median = statistics.median(firsts[name]) * 1000
                added = "" if name == "upstream" else f"   +{median - direct:.2f} ms over the upstream's own"
                print(f"   {name:<10} {median:7.2f} ms{added}")
            print("2. per-chunk cost of a whole stream (best of 3), microseconds per chunk")
            print(
                f"   {'chunks':>7} " + " ".join(f"{name:>10}" for name, _ in routes) + "   added by the proxy (chat, "
                "responses, messages)"
            )
            for chunks in SIZES:
                costs = [
                    min(timed(client, base, name, chunks)[1] for _ in range(3)) / chunks * 1e6 for name, base in routes
                ]
                added = ", ".join(f"{cost - costs[0]:.1f}" for cost in costs[1:])
                print(f"   {chunks:>7} " + " ".join(f"{cost:10.1f}" for cost in costs) + f"   {added}")
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=15)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-upstream"]:
        serve_upstream()
    else:
        main()
