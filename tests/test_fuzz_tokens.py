"""Property-based fuzzing of token extraction: a valid bundle or a TokenCaptureError, nothing else."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokens import TokenCaptureError, TokenClient

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLES = [
    json.loads((FIXTURES / name).read_text())
    for name in (
        "vllm-0.32/chat_inline_ids.response.json",
        "vllm-0.32/chat_logprobs_only.response.json",
        "vllm-0.32/chat_turn2.response.json",
        "dynamo/chat_engine_data.response.json",
        "sglang/chat_return_token_ids.response.json",
    )
]
REQUESTS = [
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True},
]
FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25,
)
special = st.sampled_from(
    [True, False, None, float("nan"), float("inf"), -float("inf"), -9999.0, 0, -1, 2**70, 1.5, "token_id:12",
     "token_id:-3", "token_id:1_0", "tökén", "\u202e", "", [], {}, [True], [1.0], ["token_id:1"], [[1, 2]],
     {"content": None}, [0] * 5000, [{"token": "token_id:7", "logprob": -0.1}]]
)  # fmt: skip


async def _fake_tokenize(body: Any) -> list[int]:
    return [1, 2, 3]


CLIENT = TokenClient("http://fuzz.invalid/v1")  # built once: an httpx client's TLS setup is slow
CLIENT.tokenize = _fake_tokenize  # type: ignore[method-assign]


def check(data: bytes | str, request: dict[str, Any]) -> None:
    """Extraction yields a consistent bundle or a TokenCaptureError; any other exception fails the test."""
    client = CLIENT

    async def run() -> None:
        try:
            completion = await client.extract(request, data)
        except TokenCaptureError:
            return
        bundle = completion.bundle
        assert len(bundle.generation_token_ids) == len(bundle.generation_log_probs)
        assert all(type(i) is int and i >= 0 for i in bundle.prompt_token_ids)
        assert all(type(i) is int and i >= 0 for i in bundle.generation_token_ids)
        assert all(type(x) is float and math.isfinite(x) for x in bundle.generation_log_probs)
        assert completion.response["choices"][0]["message"]["generation_token_ids"] is bundle.generation_token_ids

    anyio.run(run)


@FUZZ
@given(value=json_values, request=st.sampled_from(REQUESTS))
def test_arbitrary_json(value: Any, request: dict[str, Any]) -> None:
    """Any JSON document, including NaN and infinities, is a bundle or a TokenCaptureError."""
    check(json.dumps(value), request)


@FUZZ
@given(value=json_values, sample=st.sampled_from(SAMPLES))
def test_arbitrary_choice(value: Any, sample: dict[str, Any]) -> None:
    """A real envelope whose first choice (or its message, or logprobs) is anything."""
    response = copy.deepcopy(sample)
    response["choices"] = [value] if not isinstance(value, dict) else [{**response["choices"][0], **value}]
    check(json.dumps(response), REQUESTS[0])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:4]):
            found += _paths(item, (*prefix, index))
    return found


@FUZZ
@given(data=st.data(), sample=st.sampled_from(SAMPLES), request=st.sampled_from(REQUESTS))
def test_mutated_real_responses(data: st.DataObject, sample: dict[str, Any], request: dict[str, Any]) -> None:
    """Real vLLM, Dynamo and SGLang responses with fields replaced by wrong types, NaN, -9999.0, huge lists..."""
    response = copy.deepcopy(sample)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(response)))
        target = response
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = copy.deepcopy(data.draw(special | json_values))  # never share the pool's objects
    check(json.dumps(response), request)


@FUZZ
@given(
    sample=st.sampled_from(SAMPLES),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4),
)
def test_truncated_and_corrupted_bytes(sample: dict[str, Any], cut: float, flips: list[tuple[float, int]]) -> None:
    """Real responses cut short or with bytes overwritten (non-UTF-8 included)."""
    raw = bytearray(json.dumps(sample, ensure_ascii=False).encode())
    for where, byte in flips:
        raw[int(where * (len(raw) - 1))] = byte
    check(bytes(raw[: max(1, int(cut * len(raw)))] if cut < 0.9 else raw), REQUESTS[0])


def test_huge_and_empty_lists() -> None:
    """A 200,000-token prompt and an empty generation are handled without error or copies."""
    response = copy.deepcopy(SAMPLES[0])
    response["prompt_token_ids"] = list(range(200_000))
    response["usage"]["prompt_tokens"] = 200_000
    check(json.dumps(response), REQUESTS[0])
    empty = copy.deepcopy(SAMPLES[0])
    empty["choices"][0]["token_ids"] = []
    empty["choices"][0]["logprobs"]["content"] = []
    empty["usage"]["completion_tokens"] = 0
    check(json.dumps(empty), REQUESTS[0])


def test_invalid_utf8_inside_a_nested_string() -> None:
    """A byte that breaks UTF-8 inside the message (found by the fuzzer) is a TokenCaptureError."""
    raw = bytearray(json.dumps(SAMPLES[0]).encode())
    raw[raw.index(b'"content"') + 12] = 0x80
    check(bytes(raw), REQUESTS[0])
    try:
        anyio.run(CLIENT.extract, REQUESTS[0], bytes(raw))
    except TokenCaptureError as exc:
        assert "UTF-8" in str(exc)
    else:
        raise AssertionError("invalid UTF-8 was accepted")
