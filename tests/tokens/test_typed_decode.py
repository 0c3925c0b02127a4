"""The one typed pass (``tokens._typed``) against the fallback it stands in front of (``decode_response``).

Every body goes through both paths: the bundles, the response and any error (type and message)
must be the same. The recorded vLLM answers must take the fast path (else it would be untested).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.token_samples import FIXTURES, INLINE, LOGPROBS_ONLY, TOKENIZED
from tokens import TokenClient, TokensError
from tokens._decode import _MESSAGE_RAW
from tokens._stream import StreamAccumulator
from tokens._typed import _same_ids, _typed_pass
from tokens.chain import decode_response

SHARED_SAMPLES = Path(os.environ.get("VLLM_SAMPLES", "/work/shared/vllm-0.32-samples"))
SAMPLE_DIRS = [FIXTURES, FIXTURES.parent / "dynamo", FIXTURES.parent / "sglang"]
if SHARED_SAMPLES.is_dir():
    SAMPLE_DIRS.append(SHARED_SAMPLES)
REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def client(*, fallback: bool, prompt_tokens: list[int] = TOKENIZED["tokens"]) -> TokenClient:
    """A client on one path whose ``/tokenize`` answers ``prompt_tokens`` (the recorded answer by default)."""
    made = TokenClient("http://typed.invalid/v1", allow_tokenize_fallback=True)

    async def tokenize(body: Any) -> list[int]:
        return prompt_tokens

    made.tokenize = tokenize  # type: ignore[method-assign]
    if fallback:
        made._capture._decode = decode_response  # type: ignore[method-assign]
    return made


TYPED, FALLBACK = client(fallback=False), client(fallback=True)


def outcome(which: TokenClient, request: dict[str, Any], data: bytes | str) -> Any:
    """What extraction gives: the response and each bundle's fields, or the error's type and message."""
    try:
        completion = anyio.run(which.extract, request, data)
    except TokensError as exc:
        return type(exc), str(exc)
    bundles = [
        (
            b.prompt_token_ids,
            b.generation_token_ids,
            b.generation_log_probs,
            b.source,
            b.routed_experts,
            b.floored_positions,
        )
        for b in completion.bundles
    ]
    # The response as JSON too: the same keys in the same order.
    return json.dumps(completion.response), completion.response, bundles


def assert_same(
    request: dict[str, Any], data: bytes | str, clients: tuple[TokenClient, TokenClient] = (TYPED, FALLBACK)
) -> Any:
    typed, fallback = outcome(clients[0], request, data), outcome(clients[1], request, data)
    assert typed == fallback
    return typed


def recorded_answers() -> list[tuple[str, dict[str, Any], bytes]]:
    """Every recorded chat completion (with the request it answered), and the recorded stream assembled."""
    found = []
    for folder in SAMPLE_DIRS:
        for path in sorted(folder.glob("chat_*.response.json")):
            request_path = path.with_name(path.name.replace(".response.", ".request."))
            request = json.loads(request_path.read_text()) if request_path.exists() else REQUEST
            found.append((f"{folder.name}/{path.name}", request, path.read_bytes()))
        for path in sorted(folder.glob("chat_*.response.sse")):
            accumulator = StreamAccumulator(1 << 20)
            for event in accumulator.feed(path.read_bytes()):
                accumulator.record(event)
            request = json.loads(path.with_name(path.name.replace(".response.sse", ".request.json")).read_text())
            found.append((f"{folder.name}/{path.name}", request, accumulator.whole()))
    return found


@pytest.mark.parametrize(
    ("name", "request_body", "data"), recorded_answers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_recorded_answers_give_the_same_bundles_on_both_paths(
    name: str, request_body: dict[str, Any], data: bytes
) -> None:
    prompt = list(range(json.loads(data)["usage"]["prompt_tokens"]))  # for answers without prompt ids
    clients = (client(fallback=False, prompt_tokens=prompt), client(fallback=True, prompt_tokens=prompt))
    result = assert_same(TYPED._capture.prepare(request_body, streaming=True), data, clients)
    assert not isinstance(result[0], type), f"{name}: a recorded answer failed: {result}"
    has_message_bundle = any(_MESSAGE_RAW & choice.get("message", {}).keys() for choice in json.loads(data)["choices"])
    if "vllm" in name and not has_message_bundle:
        assert _typed_pass(data) is not None, f"{name}: a vLLM answer fell back to the slow path"


def test_the_fast_path_is_taken_and_the_text_comparison_spares_parsing() -> None:
    data = json.dumps(INLINE).encode()
    response = _typed_pass(data)
    assert response is not None
    ids, _ = response._logprob_tokens[0] or ([], [])
    assert ids is response.token_ids("choices[0].token_ids")  # matched as text: the inline list itself


def _mutated(change: Any) -> bytes:
    body = copy.deepcopy(INLINE)
    change(body)
    return json.dumps(body).encode()


def _set_token(position: int, text: str) -> Any:
    def change(body: dict[str, Any]) -> None:
        body["choices"][0]["logprobs"]["content"][position]["token"] = text

    return change


def _merge_tokens(body: dict[str, Any]) -> None:
    content = body["choices"][0]["logprobs"]["content"]
    content[0]["token"] = content[0]["token"] + "," + content[1]["token"]
    content[1]["token"] = "token_id:"


HOSTILE = {
    "leading zero": _set_token(0, "token_id:0" + INLINE["choices"][0]["logprobs"]["content"][0]["token"][9:]),
    "two tokens in one, with a comma": _merge_tokens,
    "prefix twice": _set_token(1, "token_id:token_id:5"),
    "other digits": _set_token(0, "token_id:\u0661"),
    "lone surrogate": _set_token(0, "token_id:\ud800"),
    "space": _set_token(0, "token_id: 5"),
    "text token": _set_token(0, "sub"),
    "shifted id": _set_token(2, "token_id:99"),
    "unknown top field": lambda body: body.update(x_extra={"a": [1]}),
    "unknown choice field": lambda body: body["choices"][0].update(x_extra=1),
    "message bundle": lambda body: body["choices"][0]["message"].update(prompt_token_ids=[1]),
    "nvext": lambda body: body.update(nvext={"engine_data": {"prompt_token_ids": [1]}}),
    "id out of range": lambda body: body["prompt_token_ids"].append(2**31),
    "boolean id": lambda body: body["choices"][0]["token_ids"].__setitem__(0, True),
    "null message": lambda body: body["choices"][0].update(message=None),
    "empty choices": lambda body: body.update(choices=[]),
    "no choices": lambda body: body.pop("choices"),
    "null logprobs": lambda body: body["choices"][0].update(logprobs=None),
    "null content": lambda body: body["choices"][0].update(logprobs={"content": None}),
    "usage disagrees": lambda body: body["usage"].update(prompt_tokens=1),
    "floored log probability": lambda body: body["choices"][0]["logprobs"]["content"][0].update(logprob=-9999.0),
    "completions-shaped logprobs": lambda body: body["choices"][0].update(
        logprobs={"tokens": [], "token_logprobs": []}
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bodies_give_the_same_answer_or_error_on_both_paths(name: str) -> None:
    data = _mutated(HOSTILE[name])
    for request in (REQUEST, {**REQUEST, "return_token_ids": True}):
        assert_same(request, data)


def test_duplicate_keys_and_deep_nesting_give_the_same_answer() -> None:
    text = json.dumps(INLINE)
    assert_same(REQUEST, text.replace('"prompt_token_ids": [', '"prompt_token_ids": [1], "prompt_token_ids": [', 1))
    assert_same(REQUEST, text[:-1] + ', "metrics": ' + "[" * 5000 + "]" * 5000 + "}")
    assert_same(REQUEST, json.dumps(LOGPROBS_ONLY))


def test_same_ids_compares_exactly() -> None:
    class Entry:
        def __init__(self, token: str) -> None:
            self.token = token

    def entries(*tokens: str) -> list[Any]:
        return [Entry(token) for token in tokens]

    assert _same_ids(entries("token_id:5", "token_id:12"), [5, 12])
    assert _same_ids([], [])
    assert not _same_ids(entries("token_id:05", "token_id:12"), [5, 12])
    assert not _same_ids(entries("token_id:5,token_id:12", "token_id:"), [5, 12])  # a comma inside a token
    assert not _same_ids(entries("token_id:5"), [5, 12])
    assert not _same_ids(entries("token_id:5", "token_id:13"), [5, 12])
    assert not _same_ids(entries("5", "token_id:12"), [5, 12])
    assert not _same_ids(entries("token_id:\ud800", "token_id:12"), [5, 12])


def test_a_completions_shaped_logprobs_is_read_as_the_fallback_reads_it() -> None:
    data = _mutated(
        lambda body: body["choices"][0].update(logprobs={"tokens": ["token_id:1"], "token_logprobs": [-0.5]})
    )
    typed = _typed_pass(data)
    assert typed is not None
    assert typed.completion_logprobs(0) == decode_response(data).completion_logprobs(0) == (["token_id:1"], [-0.5])
