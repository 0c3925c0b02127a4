"""Token capture costs, each measured side by side in one run.

Run: python bench/tokens_bench.py. Prints:

1. extraction (decode plus bundle) against plain ``json.loads`` of the same bytes, per size (goal:
   at most 0.5 at 131,072 prompt + 32,768 generated tokens);
2. ``TokenCaptureTransport`` per completion over a plain ``httpx.AsyncClient`` post and
   ``json.loads``, small responses (both over the same in-memory transport);
3. streaming capture per chunk at 1K and 32K chunks (flat is the goal);
4. beside NeMo Gym 0.7.0's own extraction (``nemo_gym.token_id_capture.adapters.vllm``, run in its
   venv on the same bytes: ``json.loads`` then the adapter), when that venv exists (goal: ours at
   most 0.67x of its time at every size).
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from tokens import TokenCaptureTransport, TokenClient

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = (ROOT / "tests" / "fixtures" / "vllm-0.32" / "chat_inline_ids.response.json").read_bytes()
NEMO_GYM_PYTHON = Path(
    os.environ.get("NEMO_GYM_PYTHON")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-sandbox-middleware"
    / "nemo-gym-0.7.0-py3.11" / "bin" / "python"
)  # fmt: skip

SIZES = [(8_192, 2_048), (131_072, 32_768)]
REPEATS = 7


def vllm_response(prompt_len: int, generation_len: int, seed: int = 0) -> bytes:
    """A response shaped exactly like vLLM 0.32's with return_token_ids and logprobs (top_logprobs=0)."""
    rng = random.Random(seed)
    generated = [rng.randrange(1, 150_000) for _ in range(generation_len)]
    content = [
        {"token": f"token_id:{i}", "logprob": -rng.random() * 12, "bytes": [rng.randrange(256) for _ in range(3)],
         "top_logprobs": []}
        for i in generated
    ]  # fmt: skip
    response = {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 1795957000, "model": "bench",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "x" * (generation_len * 4), "refusal": None,
                        "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                        "reasoning": None},
            "logprobs": {"content": content}, "finish_reason": "length", "stop_reason": None,
            "token_ids": generated, "routed_experts": None,
        }],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": prompt_len, "total_tokens": prompt_len + generation_len,
                  "completion_tokens": generation_len, "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": [rng.randrange(1, 150_000) for _ in range(prompt_len)],
        "kv_transfer_params": None,
    }  # fmt: skip
    return json.dumps(response).encode()


def best_ms(fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        gc.collect()
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


async def best_ms_async(fn: Callable[[], Awaitable[Any]]) -> float:
    """Like best_ms, timed inside one running event loop (the loop's start-up is not extraction)."""
    best = float("inf")
    for _ in range(REPEATS):
        gc.collect()
        started = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


async def plain_and_captured(
    handler: Callable[[httpx.Request], httpx.Response], measure: Callable[[httpx.AsyncClient], Awaitable[float]]
) -> tuple[float, float]:
    """``measure`` of a plain httpx client, then of one through ``TokenCaptureTransport``, same handler."""
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as plain:
        plain_us = await measure(plain)
    capture = TokenCaptureTransport(httpx.MockTransport(handler), request_prompt_and_generation_token_ids=True)
    async with httpx.AsyncClient(transport=capture) as captured:
        captured_us = await measure(captured)
    return plain_us, captured_us


async def transport_cost(rounds: int = 2000) -> tuple[float, float, float]:
    """Microseconds per small completion: plain post + json.loads, the same through the transport, TokenClient."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=SAMPLE, headers={"content-type": "application/json"})

    async def per_call(client: httpx.AsyncClient) -> float:
        async def batch() -> None:
            for _ in range(rounds):
                json.loads((await client.post("http://bench.test/v1/chat/completions", json=body)).content)

        return await best_ms_async(batch) * 1000 / rounds

    plain_us, transport_us = await plain_and_captured(handler, per_call)
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    async with http, TokenClient("http://bench.test/v1", http_client=http) as client:

        async def batch() -> None:
            for _ in range(rounds):
                await client.chat_completion(**body)

        client_us = await best_ms_async(batch) * 1000 / rounds
    return plain_us, transport_us, client_us


def sse(chunks: int) -> list[bytes]:
    """A vLLM-shaped stream of ``chunks`` one-token chunks (inline ids, id tokens), then usage and [DONE]."""
    head = '{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1795979193,"model":"bench",'
    events = [f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,'
              f'"finish_reason":null}}],"prompt_token_ids":[1,2,3,4],"prompt_text":null}}\n\n'.encode()]  # fmt: skip
    for i in range(chunks):
        token = 1000 + i % 5000
        events.append(
            f'data: {head}"choices":[{{"index":0,"delta":{{"content":"ab"}},"logprobs":{{"content":[{{"token":'
            f'"token_id:{token}","logprob":-0.5,"bytes":[97,98],"top_logprobs":[]}}]}},"finish_reason":null,'
            f'"token_ids":[{token}]}}]}}\n\n'.encode()
        )  # fmt: skip
    events.append(f'data: {head}"choices":[],"usage":{{"prompt_tokens":4,"total_tokens":{chunks + 4},'
                  f'"completion_tokens":{chunks}}}}}\n\n'.encode())  # fmt: skip
    events.append(b"data: [DONE]\n\n")
    return events


async def stream_cost(chunks: int) -> tuple[float, float]:
    """Microseconds per chunk to read a stream of ``chunks`` chunks: plainly, and through the transport."""
    events = sse(chunks)
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def handler(request: httpx.Request) -> httpx.Response:
        async def arrive() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return httpx.Response(200, content=arrive(), headers={"content-type": "text/event-stream"})

    async def per_chunk(client: httpx.AsyncClient) -> float:
        async def read() -> None:
            async with client.stream("POST", "http://bench.test/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        return await best_ms_async(read) * 1000 / chunks

    return await plain_and_captured(handler, per_chunk)


NEMO_GYM_SCRIPT = """
import gc, importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("nemo_gym_vllm_adapter", sys.argv[1])
adapter_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(adapter_module)
adapter = adapter_module.VLLMCaptureAdapter()
data = sys.stdin.buffer.read()
best = float("inf")
for _ in range(int(sys.argv[2])):
    gc.collect()
    started = time.perf_counter()
    payload = json.loads(data)
    prompt = adapter.extract_prompt_ids(payload)
    generation, log_probs = adapter.extract_generation(payload)
    best = min(best, time.perf_counter() - started)
print(best * 1000, len(prompt), len(generation))
"""


def nemo_gym_ms(data: bytes) -> float | None:
    """NeMo Gym 0.7.0's vLLM extraction on ``data`` in its own venv (ms, best of N), or None without that venv."""
    if not NEMO_GYM_PYTHON.exists():
        return None
    found = subprocess.run(
        [str(NEMO_GYM_PYTHON), "-c", "import importlib.util; "
         "print(importlib.util.find_spec('nemo_gym').submodule_search_locations[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    adapter = Path(found) / "token_id_capture" / "adapters" / "vllm.py"
    result = subprocess.run([str(NEMO_GYM_PYTHON), "-c", NEMO_GYM_SCRIPT, str(adapter), str(REPEATS)], input=data,
                            capture_output=True, check=True)  # fmt: skip
    return float(result.stdout.split()[0])


def main() -> int:
    client = TokenClient("http://unused.invalid/v1", request_prompt_and_generation_token_ids=True)
    request = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    print("1. extraction vs json.loads of the same bytes, and beside NeMo Gym 0.7.0's extraction (its venv)")
    print(f"{'prompt':>8} {'generated':>9} {'MB':>6} {'json.loads ms':>14} {'ours ms':>8} {'ratio':>6} "
          f"{'NeMo Gym ms':>12} {'ours/NeMo':>9}")  # fmt: skip
    worst = last = 0.0
    gym_ratios: list[float] = []
    for prompt_len, generation_len in SIZES:
        data = vllm_response(prompt_len, generation_len)
        completion = anyio.run(client.extract, request, data)
        assert completion.bundle.source == "vllm" and len(completion.bundle.prompt_token_ids) == prompt_len
        baseline = best_ms(lambda data=data: json.loads(data))  # type: ignore[misc]
        extraction = anyio.run(best_ms_async, lambda data=data: client.extract(request, data))
        ratio = last = extraction / baseline
        worst = max(worst, ratio)
        gym = nemo_gym_ms(data)
        gym_text = "absent" if gym is None else f"{gym:.1f}"
        gym_ratio = "-" if gym is None else f"{extraction / gym:.2f}x"
        if gym is not None:
            gym_ratios.append(extraction / gym)
        print(f"{prompt_len:>8} {generation_len:>9} {len(data) / 1e6:>6.2f} {baseline:>14.1f} {extraction:>8.1f} "
              f"{ratio:>5.2f}x {gym_text:>12} {gym_ratio:>9}")  # fmt: skip
    print(f"extraction / json.loads at {SIZES[-1][0]:,} + {SIZES[-1][1]:,} tokens: {last:.2f}x (goal <= 0.50x); "
          f"worst size {worst:.2f}x")  # fmt: skip
    if gym_ratios:
        print(f"ours / NeMo Gym 0.7.0, worst size: {max(gym_ratios):.2f}x (goal <= 0.67x)")
    else:
        print(f"NeMo Gym venv absent ({NEMO_GYM_PYTHON}): comparison skipped (bash scripts/install-nemo-gym.sh)")

    plain_us, transport_us, client_us = anyio.run(transport_cost)
    print("\n2. per small completion (recorded vLLM answer, 3 KB, in-memory transport)")
    print(
        f"plain httpx post + json.loads {plain_us:.0f} us; through TokenCaptureTransport {transport_us:.0f} us "
        f"({transport_us / plain_us:.2f}x, +{transport_us - plain_us:.0f} us); TokenClient {client_us:.0f} us"
    )

    print("\n3. streaming, per chunk (one token each)")
    print(f"{'chunks':>7} {'plain us':>9} {'captured us':>12} {'capture cost us':>16}")
    for chunks in (1_000, 32_000):
        plain, captured = anyio.run(stream_cost, chunks)
        print(f"{chunks:>7} {plain:>9.1f} {captured:>12.1f} {captured - plain:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
