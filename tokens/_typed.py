"""One typed pass over a chat completion: the fast path in front of ``decode_response``.

vLLM's answer has a known shape, so msgspec decodes all of it in one pass: the token fields typed
with the same checks as ``decode_response``'s (ids in the 32-bit vocabulary range, booleans refused,
finite log probabilities), the logprob entries' ``bytes`` and ``top_logprobs`` (most of the body's
bytes) skipped unread, every other field as plain JSON. Anything this pass does not cover (a field
it does not know, a bundle already on the message, ``nvext``, a wrong type, bad JSON, an empty
``choices``) falls back to ``decode_response``, which decodes what it is given and raises the
typed error it raises today: the fast path only ever answers when it would answer the same.

When a choice's logprob tokens read exactly ``token_id:<id>`` for each of its inline ids, the
tokens are compared as text, without parsing each of them; otherwise ``DecodedResponse`` parses
them as before (and names the first that differs).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from ._decode import _MESSAGE_RAW, DecodedResponse, TokenId, _Logprobs, decode_response

__all__ = ["decode_typed"]

_PREFIX_BYTES = b"token_id:"
_SEPARATED_PREFIX_BYTES = b"," + _PREFIX_BYTES


class _Choice(msgspec.Struct, forbid_unknown_fields=True):
    """A vLLM 0.32 chat choice; an unknown field sends the body to ``decode_response``."""

    index: Any = UNSET
    message: dict[str, Any] | UnsetType = UNSET
    logprobs: _Logprobs | UnsetType | None = UNSET
    finish_reason: Any = UNSET
    stop_reason: Any = UNSET
    token_ids: list[TokenId] | UnsetType | None = UNSET
    routed_experts: Any = UNSET
    prompt_token_ids: list[TokenId] | UnsetType | None = UNSET  # SGLang's place for them


class _Completion(msgspec.Struct, forbid_unknown_fields=True):
    """A vLLM 0.32 chat completion (fields in vLLM's order, so the body's keys keep it)."""

    choices: list[_Choice]
    id: Any = UNSET
    object: Any = UNSET
    created: Any = UNSET
    model: Any = UNSET
    service_tier: Any = UNSET
    system_fingerprint: Any = UNSET
    usage: Any = UNSET
    prompt_logprobs: Any = UNSET
    prompt_token_ids: list[TokenId] | UnsetType | None = UNSET
    prompt_text: Any = UNSET
    kv_transfer_params: Any = UNSET
    ec_transfer_params: Any = UNSET
    metrics: Any = UNSET


_decoder = msgspec.json.Decoder(_Completion)
_TOKEN_FIELDS = frozenset({"choices", "prompt_token_ids", "token_ids", "logprobs", "message"})
# The plain-JSON fields of each, in the order ``decode_response`` gives them (the message last).
_TOP_FIELDS = tuple(name for name in _Completion.__struct_fields__ if name not in _TOKEN_FIELDS)
_CHOICE_FIELDS = tuple(name for name in _Choice.__struct_fields__ if name not in _TOKEN_FIELDS)


class _TypedResponse(DecodedResponse):
    """A ``DecodedResponse`` whose token fields were all decoded in the one pass.

    A field that pass did not see was not in the body (it would have fallen back), so it is
    absent here too; ``completion_logprobs`` (another API's shape of ``logprobs``) is answered by
    ``decode_response`` on the same bytes.
    """

    __slots__ = ("_data",)

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]], data: bytes | str) -> None:
        super().__init__(body, messages, {})
        self._data = data

    def present(self, field: str) -> bool:
        return self._decoded.get(field) is not None

    def completion_logprobs(self, index: int = 0) -> tuple[list[str], list[float]] | None:
        return decode_response(self._data).completion_logprobs(index)


def _same_ids(entries: list[Any], ids: list[int]) -> bool:
    """Whether the entries' tokens are exactly ``token_id:<id>`` for ``ids``, compared as text.

    The ids' JSON (canonical digits, comma-separated) with the prefix before each id is one string;
    the tokens joined by commas equal it only if each token is exactly its id's text, since that
    string has as many commas as the tokens have separators.
    """
    if len(entries) != len(ids):
        return False
    if not ids:
        return True
    expected = _PREFIX_BYTES + msgspec.json.encode(ids)[1:-1].replace(b",", _SEPARATED_PREFIX_BYTES)
    return ",".join([entry.token for entry in entries]) == expected.decode("ascii")


def _plain(value: msgspec.Struct, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: item for name in names if (item := getattr(value, name)) is not UNSET}


def _typed_pass(data: bytes | str) -> DecodedResponse | None:
    """The response decoded in one typed pass, or None for a body it does not cover."""
    try:
        top = _decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if not top.choices:
        return None
    decoded: dict[str, Any] = {}
    matched: dict[int, tuple[list[int], list[float]] | None] = {}
    if top.prompt_token_ids is not UNSET:
        decoded["prompt_token_ids"] = top.prompt_token_ids
    choices: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(top.choices):
        message = {} if item.message is UNSET else item.message
        if not _MESSAGE_RAW.isdisjoint(message):
            return None  # a bundle on the message: decode_response holds and checks it
        choice = _plain(item, _CHOICE_FIELDS)
        choice["message"] = message
        choices.append(choice)
        messages.append(message)
        prefix = f"choices[{index}]."
        for name in ("token_ids", "logprobs", "prompt_token_ids"):
            value = getattr(item, name)
            if value is not UNSET:
                decoded[prefix + name] = value
        logprobs, generation = item.logprobs, item.token_ids
        entries = logprobs.content if isinstance(logprobs, _Logprobs) else None
        if entries is not None and isinstance(generation, list) and _same_ids(entries, generation):
            matched[index] = (generation, [entry.logprob for entry in entries])
    body = _plain(top, _TOP_FIELDS)
    body["choices"] = choices
    response = _TypedResponse(body, messages, data)
    response._decoded = decoded
    response._logprob_tokens = matched
    return response


def decode_typed(data: bytes | str) -> DecodedResponse:
    """``decode_response(data)``, in one typed pass where the body has vLLM's shape."""
    response = _typed_pass(data)
    return decode_response(data) if response is None else response
