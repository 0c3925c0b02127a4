"""Token capture costs, each measured side by side in one run.

Run: python bench/tokens_bench.py (with NeMo Gym's venv, ``bash scripts/install-nemo-gym.sh``, for
the comparison; ``NEMO_GYM_VENV`` or ``NEMO_GYM_PYTHON`` point at another one). Prints:

1. capture (a vLLM 0.32 body in, bundle and response out: ``TokenClient.extract``) beside NeMo Gym
   0.7.0's real path on the same bytes, ``orjson.loads`` (what ``nemo_gym.server_utils`` parses
   responses with) then ``nemo_gym.token_id_capture.adapters.vllm.VLLMCaptureAdapter``, and beside
   our own decode forced onto its fallback path (today's two-scan decode, the "before"), interleaved
   in one process in NeMo Gym's venv (that process's CPU time: other load on the machine does not
   count), at 1,024+256, 8,192+2,048, 32,768+8,192 and 131,072+32,768
   prompt + generated tokens (goals: capture / NeMo Gym <= 0.75 at 1,024+256 and <= 0.6 from
   8,192+2,048 up); the bundles of both of our paths must be equal, and NeMo Gym's ids ours;
   then (1b) ``TokenClient.chat_completion``'s own cost per call at 1,024+256 (its CPU time minus the
   same bare httpx post, over one in-memory transport) beside NeMo Gym's path (goal <= 0.75);
2. ``TokenCaptureTransport`` per completion over a plain ``httpx.AsyncClient`` post and
   ``json.loads``, small responses (both over the same in-memory transport);
3. streaming capture per chunk at 1K and 32K chunks (flat is the goal).
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

from tokens import TokenCaptureTransport, TokenClient, TokenCompletion
from tokens.chain import decode_response

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = (ROOT / "tests" / "fixtures" / "vllm-0.32" / "chat_inline_ids.response.json").read_bytes()
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-sandbox-middleware"
NEMO_GYM_PYTHON = Path(
    os.environ.get("NEMO_GYM_PYTHON")
    or Path(os.environ.get("NEMO_GYM_VENV") or _CACHE / f"nemo-gym-0.7.0-py{sys.version_info[0]}.{sys.version_info[1]}")
    / "bin" / "python"
)  # fmt: skip

SIZES = [(1_024, 256), (8_192, 2_048), (32_768, 8_192), (131_072, 32_768)]
GOALS = {(1_024, 256): 0.75}  # capture / NeMo Gym; 0.6 at every other size
CLIENT_SIZE, CLIENT_GOAL = (1_024, 256), 0.75  # section 1b: TokenClient's own cost / NeMo Gym's path
CLIENT_ROUNDS = 300  # section 1b: rounds of 10 calls each (the goal's margin is smaller than 15 long rounds' noise)
REPEATS = 7
ROUNDS = 15  # section 1: rounds of the interleaved timings (best of them is kept)


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


async def best_ms_async(
    fn: Callable[[], Awaitable[Any]], repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Milliseconds of the fastest of ``repeats`` runs by ``clock``, inside one running event loop (its
    start-up is not capture)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        started = clock()
        await fn()
        best = min(best, clock() - started)
    return best * 1000


async def interleaved(runs: list[Callable[[], Awaitable[Any]]], calls: int, rounds: int) -> list[float]:
    """CPU milliseconds per call of each run (``calls`` calls each), the best of ``rounds`` rounds in which
    the runs take turns."""
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for index, run in enumerate(runs):
            best[index] = min(best[index], await best_ms_async(run, 1, time.process_time) / calls)
    return best


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
    events = [
        f'data: {head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,'
        f'"finish_reason":null}}],"prompt_token_ids":[1,2,3,4],"prompt_text":null}}\n\n'.encode()
    ]
    for i in range(chunks):
        token = 1000 + i % 5000
        events.append(
            f'data: {head}"choices":[{{"index":0,"delta":{{"content":"ab"}},"logprobs":{{"content":[{{"token":'
            f'"token_id:{token}","logprob":-0.5,"bytes":[97,98],"top_logprobs":[]}}]}},"finish_reason":null,'
            f'"token_ids":[{token}]}}]}}\n\n'.encode()
        )  # fmt: skip
    events.append(
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":4,"total_tokens":{chunks + 4},'
        f'"completion_tokens":{chunks}}}}}\n\n'.encode()
    )
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


def _nemo_gym_extract() -> Callable[[bytes], tuple[list[int], list[int], list[float]]]:
    """NeMo Gym 0.7.0's path from response bytes to ids: ``orjson.loads`` then its vLLM adapter."""
    import orjson  # NeMo Gym's venv (scripts/install-nemo-gym.sh installs it)
    from nemo_gym.token_id_capture.adapters.vllm import VLLMCaptureAdapter

    adapter = VLLMCaptureAdapter()

    def extract(data: bytes) -> tuple[list[int], list[int], list[float]]:
        payload = orjson.loads(data)
        generation, log_probs = adapter.extract_generation(payload)
        return adapter.extract_prompt_ids(payload), generation, log_probs

    return extract


def same_bundles(a: TokenCompletion, b: TokenCompletion) -> bool:
    return a.response == b.response and [
        (x.prompt_token_ids, x.generation_token_ids, x.generation_log_probs, x.source, x.floored_positions)
        for x in a.bundles
    ] == [
        (y.prompt_token_ids, y.generation_token_ids, y.generation_log_probs, y.source, y.floored_positions)
        for y in b.bundles
    ]  # fmt: skip


async def capture_table() -> int:
    """Section 1, in this process: ours, ours on the fallback path, NeMo Gym's (when importable), interleaved."""
    try:
        nemo = _nemo_gym_extract()
    except ImportError as exc:
        nemo = None
        print(f"NeMo Gym's path is not importable here ({exc}): run with its venv (bash scripts/install-nemo-gym.sh)")
    request = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    typed = TokenClient("http://unused.invalid/v1", request_prompt_and_generation_token_ids=True)
    fallback = TokenClient("http://unused.invalid/v1", request_prompt_and_generation_token_ids=True)
    fallback._capture._decode = decode_response  # type: ignore[method-assign]  # today's path, forced
    print(
        "1. capture, vLLM 0.32 body in, bundle out (CPU ms of this process, best of rounds, interleaved), beside "
        "NeMo Gym 0.7.0's path: orjson.loads + VLLMCaptureAdapter"
    )
    print(
        f"{'prompt':>8} {'generated':>9} {'MB':>6} {'NeMo Gym':>9} {'ours':>8} {'ours/NeMo':>9} {'goal':>6} "
        f"{'fallback':>9} {'fallback/NeMo':>13} {'ours/fallback':>13}"
    )
    met = True
    for prompt_len, generation_len in SIZES:
        data = vllm_response(prompt_len, generation_len)
        ours_completion = await typed.extract(request, data)
        assert ours_completion.bundle.source == "vllm" and len(ours_completion.bundle.prompt_token_ids) == prompt_len
        assert same_bundles(ours_completion, await fallback.extract(request, data)), "typed and fallback differ"
        calls = max(1, 100_000 // (prompt_len + generation_len))  # each timing 10 ms or more

        async def ours(data: bytes = data, calls: int = calls) -> None:
            for _ in range(calls):
                await typed.extract(request, data)

        async def before(data: bytes = data, calls: int = calls) -> None:
            for _ in range(calls):
                await fallback.extract(request, data)

        async def peer(data: bytes = data, calls: int = calls) -> None:
            assert nemo is not None
            for _ in range(calls):
                nemo(data)

        best = await interleaved([ours, before] if nemo is None else [peer, ours, before], calls, ROUNDS)
        if nemo is None:
            ours_ms, before_ms = best
            print(
                f"{prompt_len:>8} {generation_len:>9} {len(data) / 1e6:>6.2f} {'absent':>9} {ours_ms:>8.3f} "
                f"{'-':>9} {'-':>6} {before_ms:>9.3f} {'-':>13} {ours_ms / before_ms:>12.2f}x"
            )
            continue
        prompt, generation, _ = nemo(data)
        assert (prompt, generation) == (
            ours_completion.bundle.prompt_token_ids,
            ours_completion.bundle.generation_token_ids,
        )
        nemo_ms, ours_ms, before_ms = best
        goal = GOALS.get((prompt_len, generation_len), 0.6)
        met = met and ours_ms / nemo_ms <= goal
        print(
            f"{prompt_len:>8} {generation_len:>9} {len(data) / 1e6:>6.2f} {nemo_ms:>9.3f} {ours_ms:>8.3f} "
            f"{ours_ms / nemo_ms:>8.2f}x {goal:>5.2f}x {before_ms:>9.3f} {before_ms / nemo_ms:>12.2f}x "
            f"{ours_ms / before_ms:>12.2f}x"
        )
    if nemo is not None:
        print("capture / NeMo Gym goals " + ("met at every size" if met else "NOT met at every size"))
    await client_cost_table(nemo)
    return 0


async def client_cost_table(nemo: Callable[[bytes], Any] | None) -> None:
    """Section 1b: ``TokenClient.chat_completion``'s own cost per call (its CPU time minus the same bare
    httpx post, over one in-memory transport answering the body) beside NeMo Gym's path on that body."""
    prompt_len, generation_len = CLIENT_SIZE
    data = vllm_response(prompt_len, generation_len)
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    url = "http://bench.test/v1/chat/completions"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=data, headers={"content-type": "application/json"})

    calls = 10  # short samples, many rounds: the best of each is a slice no other job on the machine disturbed
    bare_http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client_http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client = TokenClient("http://bench.test/v1", http_client=client_http, request_prompt_and_generation_token_ids=True)
    async with bare_http, client_http, client:
        assert (await client.chat_completion(**body)).bundle.source == "vllm"

        async def bare() -> None:
            for _ in range(calls):
                await bare_http.post(url, json=body)

        async def ours() -> None:
            for _ in range(calls):
                await client.chat_completion(**body)

        async def peer() -> None:
            assert nemo is not None
            for _ in range(calls):
                nemo(data)

        best = await interleaved([bare, ours] if nemo is None else [bare, ours, peer], calls, CLIENT_ROUNDS)
    bare_ms, client_ms = best[:2]
    own_ms = client_ms - bare_ms
    print(
        f"\n1b. TokenClient.chat_completion's own cost per call at {prompt_len:,}+{generation_len:,} (CPU ms, best "
        "of rounds, interleaved): its time minus the same bare httpx post over one in-memory transport"
    )
    line = f"bare post {bare_ms:.3f}, TokenClient {client_ms:.3f}, own {own_ms:.3f}"
    if nemo is None:
        print(line + "; NeMo Gym absent")
        return
    nemo_ms = best[2]
    print(
        f"{line}; NeMo Gym's path {nemo_ms:.3f}: own / NeMo Gym {own_ms / nemo_ms:.2f}x (goal <= "
        f"{CLIENT_GOAL:.2f}x: {'met' if own_ms / nemo_ms <= CLIENT_GOAL else 'NOT met'})"
    )


def capture_section() -> None:
    """Section 1 in NeMo Gym's venv when it exists (ours and its path in one process), else here alone."""
    if not NEMO_GYM_PYTHON.exists():
        print(f"NeMo Gym venv absent ({NEMO_GYM_PYTHON}): comparison skipped (bash scripts/install-nemo-gym.sh)")
        anyio.run(capture_table)
        return
    subprocess.run([str(NEMO_GYM_PYTHON), __file__, "--capture"], check=True)


def main() -> int:
    if sys.argv[1:] == ["--capture"]:
        return anyio.run(capture_table)
    capture_section()

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
