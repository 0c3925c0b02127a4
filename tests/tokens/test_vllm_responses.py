"""vLLM's /v1/responses token fields as a chain source: the recorded answer, and every way it can be wrong."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import pytest

from tests.token_samples import sample
from tokens import (
    ConflictingTokenMetadataError,
    MalformedResponseError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
)
from tokens.chain import (
    DEFAULT_CHAIN,
    Exchange,
    VLLMResponsesSource,
    build_chain,
    decode_response,
    decode_responses,
    extract_vllm_responses,
    prepare_responses_request,
)

pytestmark = pytest.mark.anyio

ANSWER = sample("responses_raw_message_tokens.response")
REQUEST = sample("responses_raw_message_tokens.request")


async def bundle_of(answer: dict[str, Any]) -> Any:
    return await build_chain()(Exchange(REQUEST, decode_responses(json.dumps(answer))))


async def test_the_recorded_answer_gives_the_exact_bundle() -> None:
    bundle = await bundle_of(ANSWER)
    assert bundle.source == "vllm-responses" and bundle.exact
    assert bundle.prompt_token_ids == ANSWER["input_messages"][0]["tokens"]
    assert bundle.generation_token_ids == ANSWER["output_messages"][0]["tokens"]
    assert bundle.generation_log_probs == [entry["logprob"] for entry in ANSWER["output"][0]["content"][0]["logprobs"]]
    assert VLLMResponsesSource in DEFAULT_CHAIN


def test_the_answer_is_kept_without_the_raw_items() -> None:
    decoded = decode_responses(json.dumps(ANSWER))
    assert "input_messages" not in decoded.answer and "choices" not in decoded.answer
    assert decoded.answer["output"] == ANSWER["output"]


def test_a_chat_completion_is_not_this_source() -> None:
    chat = decode_response(json.dumps(sample("chat_inline_ids.response")))
    assert extract_vllm_responses(chat) is None
    without = {key: value for key, value in ANSWER.items() if key not in ("input_messages", "output_messages")}
    assert extract_vllm_responses(decode_responses(json.dumps(without))) is None


def changed(path: str, value: Any) -> dict[str, Any]:
    answer = copy.deepcopy(ANSWER)
    *parents, last = path.split(".")
    target: Any = answer
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is KeyError:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return answer


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        (changed("output_messages", KeyError), PartialTokenMetadataError, "no output_messages"),
        (changed("input_messages", None), PartialTokenMetadataError, "no input_messages"),
        (changed("output.0.content.0.logprobs", None), MissingTokenMetadataError, "message.output_text.logprobs"),
        (changed("output_messages.0.tokens", [717, 1201]), MalformedTokenMetadataError, "pair one to one"),
        (changed("output_messages.0.tokens.0", -1), MalformedTokenMetadataError, "output_messages"),
        (changed("output_messages.0.tokens.0", True), MalformedTokenMetadataError, "output_messages"),
        (changed("output.0.content.0.logprobs.0.logprob", "x"), MalformedTokenMetadataError, "logprobs"),
        (changed("usage.input_tokens", 17), ConflictingTokenMetadataError, "usage.input_tokens is 17"),
        (changed("usage.output_tokens", 9), ConflictingTokenMetadataError, "usage.output_tokens is 9"),
        (changed("output_messages", [ANSWER["output_messages"][0]] * 2), MalformedTokenMetadataError, "2 items"),
    ],
)
async def test_bad_token_fields_are_typed_errors(answer: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        await bundle_of(answer)


@pytest.mark.parametrize("data", [b"[1]", b"{", b'{"output": 3}', b"[" * 100_000])
def test_bodies_that_are_not_responses_answers(data: bytes) -> None:
    with pytest.raises(MalformedResponseError):
        decode_responses(data)


def test_the_request_asks_for_ids_and_log_probabilities_and_drops_echoed_bundles() -> None:
    echoed = {
        "type": "message",
        "role": "assistant",
        "content": "hi",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-0.1],
    }
    body = {"model": "tiny", "input": [echoed], "include": ["reasoning.encrypted_content"], "top_logprobs": 5}
    sent = prepare_responses_request(body)
    assert sent["enable_response_messages"] is True and sent["top_logprobs"] == 0
    assert sent["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert sent["input"] == [{"type": "message", "role": "assistant", "content": "hi"}]
    assert body["input"][0] is echoed and "prompt_token_ids" in echoed  # the caller's body is not changed
    assert msgspec.json.decode(msgspec.json.encode(sent)) == sent
