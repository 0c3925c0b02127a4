"""Property-based fuzzing of token extraction: a valid bundle or a TokenCaptureError, nothing else, and
the same answer from the typed pass as from its fallback (today's decode)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokens import TokenBundle, TokenCaptureError, TokenClient, TokenCompletion
from tokens.chain import DEFAULT_CHAIN, MAX_TOKEN_ID, Exchange, TokenMiddleware, decode_response

FIXTURES = Path(__file__).parents[1] / "fixtures"
SAMPLES = [
    json.loads((FIXTURES / name).read_text())
    for name in (
        "vllm-0.32/chat_inline_ids.response.json",
        "vllm-0.32/chat_logprobs_only.response.json",
        "vllm-0.32/chat_turn2.response.json",
        "vllm-0.32/chat_n2_inline_ids.response.json",
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
    [
        True,
        False,
        None,
        float("nan"),
        float("inf"),
        -float("inf"),
        -9999.0,
        0,
        -1,
        2**70,
        1.5,
        "token_id:12",
        "token_id:-3",
        "token_id:1_0",
        "tökén",
        "\u202e",
        "",
        [],
        {},
        [True],
        [1.0],
        ["token_id:1"],
        [[1, 2]],
        {"content": None},
        [0] * 5000,
        [{"token": "token_id:7", "logprob": -0.1}],
        2**31 - 1,
        2**31,
        10**40,
        "token_id:5\ntoken_id:6",
        "token_id:" + "9" * 5000,
    ]
)


async def _fake_tokenize(body: Any) -> list[int]:
    return [1, 2, 3]


STATS = {"examples": 0, "reached": 0}


class Probe(TokenMiddleware):
    """Outermost chain step: counts the examples whose body decoded as a completion and reached extraction."""

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        STATS["reached"] += 1
        return await self.inner(exchange)


CLIENT = TokenClient("http://fuzz.invalid/v1", middleware=(Probe, *DEFAULT_CHAIN))  # built once: TLS setup is slow
CLIENT.tokenize = _fake_tokenize  # type: ignore[method-assign]
# The same extraction on today's decode (the typed pass's fallback): every example must give the same answer.
FALLBACK = TokenClient("http://fuzz.invalid/v1")
FALLBACK.tokenize = _fake_tokenize  # type: ignore[method-assign]
FALLBACK._capture._decode = decode_response  # type: ignore[method-assign]


def _outcome(completion: TokenCompletion | TokenCaptureError) -> Any:
    if isinstance(completion, TokenCaptureError):
        return type(completion), str(completion)
    return completion.response, [
        (b.prompt_token_ids, b.generation_token_ids, b.generation_log_probs, b.source, b.floored_positions)
        for b in completion.bundles
    ]


async def _extract(client: TokenClient, data: bytes | str, request: dict[str, Any]) -> Any:
    try:
        return await client.extract(request, data)
    except TokenCaptureError as exc:
        return exc


def check(data: bytes | str, request: dict[str, Any]) -> None:
    """Extraction yields a consistent bundle or a TokenCaptureError; any other exception fails the test."""
    client = CLIENT
    STATS["examples"] += 1

    async def run() -> None:
        completion = await _extract(client, data, request)
        assert _outcome(completion) == _outcome(await _extract(FALLBACK, data, request))
        if isinstance(completion, TokenCaptureError):
            return
        assert len(completion.bundles) == len(completion.response["choices"])
        for bundle, choice in zip(completion.bundles, completion.response["choices"], strict=True):
            assert len(bundle.generation_token_ids) == len(bundle.generation_log_probs)
            assert all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in bundle.prompt_token_ids)
            assert all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in bundle.generation_token_ids)
            assert all(type(x) is float and math.isfinite(x) for x in bundle.generation_log_probs)
            assert choice["message"]["generation_token_ids"] is bundle.generation_token_ids
            assert bundle.prompt_token_ids == completion.bundle.prompt_token_ids

    anyio.run(run)


def fuzz(name: str, test: Callable[[], None], capsys: pytest.CaptureFixture[str], at_least: float) -> None:
    """Run a hypothesis test, print the share of its examples that reached extraction and require ``at_least``."""
    STATS.update(examples=0, reached=0)
    test()
    examples, reached = STATS["examples"], STATS["reached"]
    share = reached / max(examples, 1)
    with capsys.disabled():
        print(f"\n{name}: {reached} of {examples} examples reached extraction ({share:.0%})")
    assert share >= at_least, f"{name}: only {share:.0%} of the examples reached extraction"


@FUZZ
@given(value=json_values, request=st.sampled_from(REQUESTS))
def arbitrary_json(value: Any, request: dict[str, Any]) -> None:
    check(json.dumps(value), request)


def test_arbitrary_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Any JSON document, including NaN and infinities, is a bundle or a TokenCaptureError (few reach extraction)."""
    fuzz("arbitrary JSON", arbitrary_json, capsys, at_least=0.0)


CHOICE_KEYS = st.sampled_from(
    [
        "index",
        "message",
        "token_ids",
        "prompt_token_ids",
        "logprobs",
        "finish_reason",
        "routed_experts",
        "stop_reason",
        "x",
    ]
)


@FUZZ
@given(fields=st.dictionaries(CHOICE_KEYS, special | json_values, max_size=3), sample=st.sampled_from(SAMPLES))
def arbitrary_choice(fields: dict[str, Any], sample: dict[str, Any]) -> None:
    response = copy.deepcopy(sample)
    response["choices"][0].update(copy.deepcopy(fields))
    check(json.dumps(response), REQUESTS[0])


def test_arbitrary_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """A real envelope whose first choice gets arbitrary values in its fields (the message included)."""
    fuzz("arbitrary choice", arbitrary_choice, capsys, at_least=0.5)


# Where the token metadata lives in the samples: mutations aim here, so most examples are real
# responses with a damaged token source, not bodies rejected before extraction.
TOKEN_ROOTS = (
    ("prompt_token_ids",),
    ("nvext", "engine_data"),
    ("usage",),
    *(("choices", i, key) for i in (0, 1) for key in ("token_ids", "prompt_token_ids", "logprobs", "message")),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:4]):
            found += _paths(item, (*prefix, index))
    return found


def _token_paths(response: Any) -> list[tuple[Any, ...]]:
    return [path for path in _paths(response) if any(path[: len(root)] == root for root in TOKEN_ROOTS)]


def _mutate(response: Any, data: st.DataObject) -> None:
    """One mutation at a token path: replace the value, delete it, or damage a list (drop, repeat, shift an id)."""
    path = data.draw(st.sampled_from(_token_paths(response)))
    parent = response
    for step in path[:-1]:
        parent = parent[step]
    key, value = path[-1], parent[path[-1]]
    action = data.draw(
        st.sampled_from(["replace", "delete", "list"] if isinstance(value, list) else ["replace", "delete"])
    )
    if action == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif action == "replace":
        parent[key] = copy.deepcopy(data.draw(special | json_values))  # never share the pool's objects
    elif value:
        index = data.draw(st.integers(0, len(value) - 1))
        how = data.draw(st.sampled_from(["drop", "repeat", "shift"]))
        if how == "drop":
            value.pop(index)
        elif how == "repeat":
            value.insert(index, copy.deepcopy(value[index]))
        elif isinstance(value[index], int) and not isinstance(value[index], bool):
            value[index] += data.draw(st.sampled_from([1, -1, 2**31, -(2**31)]))


@FUZZ
@given(data=st.data(), sample=st.sampled_from(SAMPLES), request=st.sampled_from(REQUESTS))
def mutated_real_responses(data: st.DataObject, sample: dict[str, Any], request: dict[str, Any]) -> None:
    response = copy.deepcopy(sample)
    for _ in range(data.draw(st.integers(1, 3))):
        if _token_paths(response):
            _mutate(response, data)
    check(json.dumps(response), request)


def test_mutated_real_responses(capsys: pytest.CaptureFixture[str]) -> None:
    """Real vLLM, Dynamo and SGLang responses with token fields replaced (wrong types, NaN, -9999.0, huge
    lists...), deleted, or with ids dropped, repeated and shifted: most reach extraction."""
    fuzz("mutated real responses", mutated_real_responses, capsys, at_least=0.6)


@FUZZ
@given(
    sample=st.sampled_from(SAMPLES),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4),
)
def truncated_and_corrupted_bytes(sample: dict[str, Any], cut: float, flips: list[tuple[float, int]]) -> None:
    raw = bytearray(json.dumps(sample, ensure_ascii=False).encode())
    for where, byte in flips:
        raw[int(where * (len(raw) - 1))] = byte
    check(bytes(raw[: max(1, int(cut * len(raw)))] if cut < 0.9 else raw), REQUESTS[0])


def test_truncated_and_corrupted_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """Real responses cut short or with bytes overwritten (non-UTF-8 included); few survive to extraction."""
    fuzz("truncated and corrupted bytes", truncated_and_corrupted_bytes, capsys, at_least=0.0)


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
