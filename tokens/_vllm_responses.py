"""vLLM's ``/v1/responses`` token fields as a source of the chain (source ``vllm-responses``).

vLLM 0.32 answers a Responses API request with the exact ids only when asked:
``enable_response_messages: true`` adds ``input_messages`` and ``output_messages``, items of type
``raw_message_tokens`` holding the prompt's and the answer's ids, and
``include: ["message.output_text.logprobs"]`` one log probability per generated token on the
``output_text`` parts (``return_token_ids`` is ignored there). ``prepare_responses_request`` asks
for both; ``decode_responses`` holds such an answer for the chain, whose ``VLLMResponsesSource``
reads the three fields and cross-checks them: ids against log probabilities one to one, and both
against ``usage.input_tokens`` / ``usage.output_tokens``.

vLLM attaches log probabilities to ``output_text`` only: an answer parsed into a tool call has
none, so a request with tools is better served through chat completions (the proxy does that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ._decode import MAX_TOKEN_ID, DecodedResponse, object_fields
from ._errors import (
    ConflictingTokenMetadataError,
    MalformedResponseError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    TokenCaptureError,
)
from ._exchange import Candidate, PureSource

__all__ = [
    "LOGPROBS_INCLUDE",
    "RESPONSES_SOURCE",
    "TOKEN_FIELDS",
    "ResponsesAnswer",
    "VLLMResponsesSource",
    "decode_responses",
    "extract_vllm_responses",
    "prepare_responses_request",
    "without_token_fields",
]

RESPONSES_SOURCE = "vllm-responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""The bundle's fields, as capture attaches them (to a message, or to the last Responses output item)."""

_TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class _RawMessage(msgspec.Struct):
    tokens: list[_TokenId]
    type: str = "raw_message_tokens"


class _Logprob(msgspec.Struct):
    logprob: float


class ResponsesAnswer(DecodedResponse):
    """A ``/v1/responses`` answer as the chain sees it: one choice, the raw token items held aside."""

    def __init__(self, body: dict[str, Any], held: dict[str, msgspec.Raw]) -> None:
        message: dict[str, Any] = {}
        super().__init__({**body, "choices": [{"index": 0, "message": message}]}, [message], {})
        self.answer = body
        """The answer as decoded, without ``input_messages`` / ``output_messages``."""
        self.held = held


_messages = msgspec.json.Decoder(list[_RawMessage] | None)
_logprobs = msgspec.json.Decoder(list[_Logprob] | None)
_any = msgspec.json.Decoder()
_HELD = ("input_messages", "output_messages")
_PHRASES = (
    "{what} is JSON nested too deeply",
    "{what} is not a JSON object: {exc}",
    "{what} is not a JSON object: {exc}",
)


def prepare_responses_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses request as sent to vLLM: raw message tokens and output log probabilities on,
    one log probability per token; the bundle fields a client echoes back on input items removed."""
    sent = dict(body)
    include = body.get("include")
    included = [item for item in include if item != LOGPROBS_INCLUDE] if isinstance(include, list) else []
    sent["include"] = [*included, LOGPROBS_INCLUDE]
    sent["enable_response_messages"] = True
    sent["top_logprobs"] = 0
    items = body.get("input")
    if isinstance(items, list):
        sent["input"] = [without_token_fields(item) for item in items]
    return sent


_ECHOED = frozenset({*TOKEN_FIELDS, "token_bundles"})
_PROVIDER_FIELDS = "provider_specific_fields"  # where litellm keeps a message's unknown fields, and sends them back


def without_token_fields(item: Any) -> Any:
    """``item`` (an input item, a chat message) without the bundle fields a client may echo back from an
    earlier answer: on the item itself, or where litellm keeps them (``provider_specific_fields``)."""
    if not isinstance(item, dict):
        return item
    extra = item.get(_PROVIDER_FIELDS)
    echoed_extra = isinstance(extra, dict) and not _ECHOED.isdisjoint(extra)
    if _ECHOED.isdisjoint(item) and not echoed_extra:
        return item
    cleaned = {key: value for key, value in item.items() if key not in _ECHOED}
    if isinstance(extra, dict) and echoed_extra:
        kept = {key: value for key, value in extra.items() if key not in _ECHOED}
        if kept:
            cleaned[_PROVIDER_FIELDS] = kept
        else:
            del cleaned[_PROVIDER_FIELDS]
    return cleaned


def decode_responses(data: bytes | str) -> ResponsesAnswer:
    """A ``/v1/responses`` answer held for the chain as one choice (``ResponsesAnswer``)."""
    fields = object_fields(data, "the Responses answer", MalformedResponseError, _PHRASES)
    held = {name: fields.pop(name) for name in _HELD if name in fields}
    try:
        body = {key: _any.decode(value) for key, value in fields.items()}
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise MalformedResponseError(f"the Responses answer does not decode: {exc or 'nested too deeply'}") from exc
    if not isinstance(body.get("output"), list):
        raise MalformedResponseError("the answer has no 'output' list; is this a Responses API answer?")
    return ResponsesAnswer(body, held)


def _raw_tokens(response: ResponsesAnswer, name: str) -> list[int] | None:
    raw = response.held.get(name)
    if raw is None or bytes(raw) == b"null":
        return None
    try:
        items = _messages.decode(raw)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise MalformedTokenMetadataError(f"{name}: {exc or 'nested too deeply'}") from exc
    if items is None:
        return None
    if len(items) != 1 or items[0].type != "raw_message_tokens":
        raise MalformedTokenMetadataError(
            f"{name} has {len(items)} items; capture reads one raw_message_tokens item per response (several "
            "mean server-side tool turns, whose prompts are not one generation's)"
        )
    return items[0].tokens


def _output_log_probs(body: Mapping[str, Any]) -> list[float] | None:
    """The log probabilities of every ``output_text`` part, in order; None when none has any."""
    found: list[float] | None = None
    for position, item in enumerate(body["output"]):
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part_index, part in enumerate(item.get("content") or ()):
            if not isinstance(part, dict) or part.get("type") != "output_text" or part.get("logprobs") is None:
                continue
            try:
                entries = msgspec.convert(part["logprobs"], list[_Logprob])
            except msgspec.ValidationError as exc:
                where = f"output[{position}].content[{part_index}].logprobs"
                raise MalformedTokenMetadataError(f"{where}: {exc}") from exc
            found = [] if found is None else found
            found.extend(entry.logprob for entry in entries)
    return found


def extract_vllm_responses(response: DecodedResponse, index: int = 0) -> Candidate | None:
    """vLLM's Responses token fields: ``input_messages`` (prompt ids), ``output_messages``
    (generation ids) and the ``output_text`` log probabilities; or None when neither id field is there."""
    if (
        index
        or not isinstance(response, ResponsesAnswer)
        or not any(bytes(raw) != b"null" for raw in response.held.values())
    ):
        return None
    prompt = _raw_tokens(response, "input_messages")
    generation = _raw_tokens(response, "output_messages")
    log_probs = _output_log_probs(response.answer)
    problem: TokenCaptureError | None = None
    if prompt is None or generation is None:
        there, absent = (
            ("input_messages", "output_messages") if generation is None else ("output_messages", "input_messages")
        )
        problem = PartialTokenMetadataError(
            f"the Responses answer has {there} but no {absent}; vLLM sends both with enable_response_messages=true"
        )
    elif log_probs is None:
        if generation:
            problem = MissingTokenMetadataError(
                "the Responses answer has raw message tokens but no output_text log probabilities; request "
                f"include=[{LOGPROBS_INCLUDE!r}] (vLLM gives none for an answer parsed into tool calls)"
            )
        log_probs = []
    elif len(generation) != len(log_probs):
        raise MalformedTokenMetadataError(
            f"output_messages[0].tokens has {len(generation)} ids but the output_text parts have {len(log_probs)} "
            "log probabilities; they must pair one to one"
        )
    if problem is None:
        assert prompt is not None and generation is not None
        _check_usage(response.answer.get("usage"), len(prompt), len(generation))
    return Candidate(RESPONSES_SOURCE, prompt, generation, log_probs, problem)


def _check_usage(usage: Any, prompt: int, generation: int) -> None:
    if not isinstance(usage, dict):
        return
    for key, length in (("input_tokens", prompt), ("output_tokens", generation)):
        count = usage.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count != length:
            raise ConflictingTokenMetadataError(
                f"usage.{key} is {count} but the {RESPONSES_SOURCE!r} source has {length} ids; the server's "
                "accounting and its token lists disagree"
            )


class VLLMResponsesSource(PureSource):
    """vLLM's ``/v1/responses`` raw message tokens with output log probabilities (source ``vllm-responses``)."""

    extract = staticmethod(extract_vllm_responses)
