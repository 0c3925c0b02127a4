"""Dynamo and SGLang sources, cross-checks (usage, the -9999.0 floor, ignored return_token_ids) and token telemetry."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx
from opentelemetry.trace import StatusCode

from sandbox_middleware.testing.fixtures import TelemetryCapture
from tokens import (
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    TokenClient,
    TokenIdsIgnoredError,
)

from .test_client import BASE, CHAT, INLINE, LOGPROBS_ONLY, TOKENIZE, TOKENIZED, USER_BODY, _set, complete

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).parents[1] / "fixtures"
DYNAMO = json.loads((FIXTURES / "dynamo" / "chat_engine_data.response.json").read_text())
SGLANG = json.loads((FIXTURES / "sglang" / "chat_return_token_ids.response.json").read_text())
PROMPT = INLINE["prompt_token_ids"]
GENERATION = INLINE["choices"][0]["token_ids"]


# -- Dynamo: nvext.engine_data ---------------------------------------------------------------


async def test_dynamo_engine_data() -> None:
    """nvext.engine_data gives an exact bundle in one request; the rest of nvext is kept."""
    completion = await complete(DYNAMO, token_ids=False)
    assert completion.bundle.source == "dynamo" and completion.bundle.exact
    assert completion.bundle.prompt_token_ids == PROMPT
    assert completion.bundle.generation_token_ids == GENERATION
    assert completion.calls == (1, 0)
    assert completion.response["nvext"] == {"worker_id": {"prefill_worker_id": 7, "decode_worker_id": 7}}


@pytest.mark.parametrize("drop", ["prompt_token_ids", "completion_token_ids", "completion_logprobs"])
async def test_dynamo_partial(drop: str) -> None:
    """engine_data with one of its three fields missing is partial, naming it."""
    response = copy.deepcopy(DYNAMO)
    del response["nvext"]["engine_data"][drop]
    with pytest.raises(PartialTokenMetadataError, match=f"but not nvext.engine_data.{drop}"):
        await complete(response, token_ids=False)


DYNAMO_MALFORMED = [
    ("bool id", _set("nvext/engine_data/prompt_token_ids/0", True), r"engine_data\.prompt_token_ids\[0\]"),
    ("string logprob", _set("nvext/engine_data/completion_logprobs/2", "x"), r"completion_logprobs\[2\]"),
    ("not a list", _set("nvext/engine_data/completion_token_ids", 5), r"completion_token_ids: Expected `array"),
    ("engine_data not object", _set("nvext/engine_data", [1]), r"nvext\.engine_data: expected an object"),
    ("lengths", _set("nvext/engine_data/completion_logprobs", [-1.0]), "must pair one to one"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), DYNAMO_MALFORMED, ids=[c[0] for c in DYNAMO_MALFORMED])
async def test_dynamo_malformed(case: str, mutate: Any, message: str) -> None:
    """Every shape rule of the vLLM source holds for Dynamo's fields too."""
    response = copy.deepcopy(DYNAMO)
    mutate(response)
    with pytest.raises(MalformedTokenMetadataError, match=message):
        await complete(response, token_ids=False)


async def test_dynamo_conflicts_with_inline_ids() -> None:
    """Dynamo's ids and vLLM inline ids in one response must agree."""
    response = copy.deepcopy(DYNAMO)
    response["prompt_token_ids"] = [*PROMPT[:-1], 9]
    response["choices"][0]["token_ids"] = GENERATION
    response["choices"][0]["logprobs"] = INLINE["choices"][0]["logprobs"]
    with pytest.raises(ConflictingTokenMetadataError, match="'dynamo' source and the 'vllm' source"):
        await complete(response)


# -- SGLang: ids on the choice ------------------------------------------------------------------


async def test_sglang_inline_ids() -> None:
    """SGLang's choice.prompt_token_ids and choice.token_ids give the bundle; text tokens are fine."""
    completion = await complete(SGLANG)
    assert completion.bundle.source == "sglang"
    assert completion.bundle.prompt_token_ids == PROMPT and completion.bundle.generation_token_ids == GENERATION
    assert completion.bundle.generation_log_probs == [e["logprob"] for e in SGLANG["choices"][0]["logprobs"]["content"]]
    choice = completion.response["choices"][0]
    assert "prompt_token_ids" not in choice and "token_ids" not in choice and "logprobs" not in choice
    assert choice["matched_stop"] is None and completion.response["metadata"] == {"weight_version": "default"}


async def test_sglang_partial_and_missing() -> None:
    """Prompt ids without generation ids are partial; ids without logprobs are missing log probabilities."""
    response = copy.deepcopy(SGLANG)
    del response["choices"][0]["token_ids"]
    with pytest.raises(PartialTokenMetadataError, match="no choices\\[0\\]\\.token_ids"):
        await complete(response)
    response = copy.deepcopy(SGLANG)
    response["choices"][0]["logprobs"] = None
    with pytest.raises(MissingTokenMetadataError, match="SGLang inline ids but no"):
        await complete(response)


SGLANG_MALFORMED = [
    ("bool id", _set("choices/0/prompt_token_ids/1", False), r"choices\[0\]\.prompt_token_ids\[1\]"),
    ("float id", _set("choices/0/token_ids/0", 1.5), r"choices\[0\]\.token_ids\[0\]"),
    ("bool logprob", _set("choices/0/logprobs/content/0/logprob", True), r"content\[0\]\.logprob"),
    ("entry not object", _set("choices/0/logprobs/content/0", 3), r"content\[0\]: Expected `object`"),
    ("lengths", _set("choices/0/token_ids", GENERATION[:-1]), "5 ids but choices\\[0\\]\\.logprobs\\.content has 6"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), SGLANG_MALFORMED, ids=[c[0] for c in SGLANG_MALFORMED])
async def test_sglang_malformed(case: str, mutate: Any, message: str) -> None:
    """Every shape rule of the vLLM source holds for SGLang's fields too."""
    response = copy.deepcopy(SGLANG)
    mutate(response)
    with pytest.raises(MalformedTokenMetadataError, match=message):
        await complete(response)


async def test_sglang_with_token_id_logprobs_is_cross_checked() -> None:
    """When SGLang's logprob tokens are token ids, they must equal choice.token_ids."""
    response = copy.deepcopy(SGLANG)
    response["choices"][0]["logprobs"] = copy.deepcopy(INLINE["choices"][0]["logprobs"])
    response["choices"][0]["logprobs"]["content"][3]["token"] = "token_id:1"
    with pytest.raises(ConflictingTokenMetadataError, match=r"'sglang' source .* at index 3"):
        await complete(response)


# -- cross-checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "count"), [("prompt_tokens", 45), ("completion_tokens", 7)])
async def test_usage_must_match(key: str, count: int) -> None:
    """usage counts that differ from the list lengths are a conflict naming the field."""
    response = copy.deepcopy(INLINE)
    response["usage"][key] = count
    with pytest.raises(ConflictingTokenMetadataError, match=f"usage.{key} is {count}"):
        await complete(response)


async def test_log_prob_floor_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """-9999.0 log probabilities are reported by position and logged, not silently kept."""
    response = copy.deepcopy(INLINE)
    for index in (1, 4):
        response["choices"][0]["logprobs"]["content"][index]["logprob"] = -9999.0
    completion = await complete(response)
    assert completion.bundle.floored_positions == (1, 4)
    assert any("-9999.0 log-probability floor" in r.getMessage() for r in caplog.records)
    clean = await complete(INLINE)
    assert clean.bundle.floored_positions == ()


async def test_non_finite_log_probs_are_malformed() -> None:
    """A log probability beyond the float range (inf) is malformed, never a number in the bundle."""
    data = json.dumps(INLINE).replace('"logprob": -7.740034580230713', '"logprob": -1e999').encode()
    with pytest.raises(MalformedTokenMetadataError, match="content\\[0\\]\\.logprob: Number out of range"):
        await complete(data)


async def test_ignored_return_token_ids_is_an_error_by_default() -> None:
    """Inline ids requested but not sent: an error, with no /tokenize call; allowed on request."""
    with pytest.raises(TokenIdsIgnoredError, match="allow_tokenize_fallback=True"):
        await complete(LOGPROBS_ONLY, token_ids=True)
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True, allow_tokenize_fallback=True) as client:
        with respx.mock() as router:
            router.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
            tokenize = router.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
            completion = await client.chat_completion(**USER_BODY)
    assert completion.bundle.source == "tokenize" and not completion.bundle.exact and tokenize.call_count == 1


# -- telemetry ----------------------------------------------------------------------------------


async def test_token_telemetry(telemetry: TelemetryCapture) -> None:
    """Sources and errors are counted, the fallback timed, and each completion has a span."""
    async with TokenClient(
        BASE, meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider
    ) as client:
        with respx.mock() as router:
            chat = router.post(CHAT)
            router.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
            for body in (INLINE, INLINE, LOGPROBS_ONLY):
                chat.mock(return_value=httpx.Response(200, json=body))
                await client.chat_completion(**USER_BODY)
            broken = copy.deepcopy(INLINE)
            broken["choices"][0]["token_ids"][0] = True
            chat.mock(return_value=httpx.Response(200, json=broken))
            with pytest.raises(MalformedTokenMetadataError):
                await client.chat_completion(**USER_BODY)
    assert telemetry.value("tokens.capture.source_total", tokens__source="vllm") == 2
    assert telemetry.value("tokens.capture.source_total", tokens__source="tokenize") == 1
    assert telemetry.value("tokens.capture.error_total", error__type="tokens.MalformedTokenMetadataError") == 1
    assert telemetry.histogram_count("tokens.tokenize_fallback.duration_ms") == 1
    spans = telemetry.spans("tokens.chat_completion")
    assert len(spans) == 4
    ok = spans[0].attributes or {}
    assert ok["tokens.source"] == "vllm" and ok["tokens.exact"] is True
    assert ok["tokens.prompt_count"] == len(PROMPT) and ok["tokens.generation_count"] == len(GENERATION)
    assert (spans[2].attributes or {})["tokens.exact"] is False
    assert spans[3].status.status_code is StatusCode.ERROR
