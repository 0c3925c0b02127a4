"""Decoding a chat completion for token extraction, fast at 128K-token lengths.

The response is scanned once into raw slices; the token fields (the large part) are decoded
straight into typed lists by msgspec, which rejects booleans for ints, non-numbers for log
probabilities, non-finite numbers and ids outside a signed 32-bit vocabulary index, and everything
else is decoded as plain JSON. The token fields are decoded only when an extraction step asks for
them, and at most once. Every way a body can be malformed (not JSON, nested too deep, wrong types,
bad digits) is a ``MalformedResponseError`` (``MalformedTokenMetadataError`` for a token field).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from ._errors import MalformedResponseError, MalformedTokenMetadataError

__all__ = ["MAX_TOKEN_ID", "DecodedResponse", "decode_response", "decode_tokenize"]

MAX_TOKEN_ID = 2**31 - 1
"""The largest id accepted: ids are indexes into a vocabulary, which fits a signed 32-bit int."""

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class _LogprobEntry(msgspec.Struct, gc=False):
    token: str
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_LogprobEntry] | None = None


class _CompletionLogprobs(msgspec.Struct):
    """The completions API's logprobs: parallel lists (``token_logprobs`` may not hold nulls here)."""

    tokens: list[str]
    token_logprobs: list[float]


_DECODE_ERRORS = (msgspec.MsgspecError, RecursionError)  # msgspec raises RecursionError on deep nesting
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_ids = msgspec.json.Decoder(list[TokenId] | None)
_floats = msgspec.json.Decoder(list[float] | None)
_logprobs = msgspec.json.Decoder(_Logprobs | None)
_completion_logprobs = msgspec.json.Decoder(_CompletionLogprobs | None)
_any = msgspec.json.Decoder()

_TOKEN_PREFIX = "token_id:"
# At most 10 digits (MAX_TOKEN_ID has 10); the range itself is checked on the integers.
_TOKEN_LINES = re.compile(r"token_id:[0-9]{1,10}(?:\ntoken_id:[0-9]{1,10})*")
_TOKEN = re.compile(r"token_id:[0-9]{1,10}")

# Fields held raw until an extraction step decodes them typed, by container.
_TOP_RAW = frozenset({"prompt_token_ids"})  # vLLM
_CHOICE_RAW = frozenset({"token_ids", "logprobs", "prompt_token_ids"})  # vLLM, SGLang (prompt ids on the choice)
_MESSAGE_RAW = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})  # NeMo RL
_ENGINE_DATA_RAW = frozenset({"prompt_token_ids", "completion_token_ids", "completion_logprobs"})  # Dynamo


def _validation_error(field: str, exc: BaseException) -> MalformedTokenMetadataError:
    if isinstance(exc, RecursionError):
        return MalformedTokenMetadataError(f"{field}: nested too deeply to be token metadata")
    message, _, path = str(exc).partition(" - at `")
    where = field + path.rstrip("`")[1:] if path else field
    if "out of range" in message or "<= 2147483647" in message:
        message += f" (token ids are vocabulary indexes: 0 to {MAX_TOKEN_ID:,})"
    return MalformedTokenMetadataError(f"{where}: {message}")


def _generic(raw: msgspec.Raw | bytes, field: str) -> Any:
    try:
        return _any.decode(raw)
    except RecursionError as exc:
        raise MalformedResponseError(f"{field}: JSON nested too deeply") from exc
    except msgspec.MsgspecError as exc:  # the raw scan does not check what is inside strings (UTF-8)
        raise MalformedResponseError(f"{field}: {exc}") from exc


def decode_tokenize(data: bytes) -> list[int]:
    """The ids of a ``/tokenize`` response body, checked like every other source's."""
    fields = object_fields(data, "/tokenize response", MalformedResponseError)
    raw = fields.get("tokens")
    try:
        ids: list[int] | None = None if raw is None else _ids.decode(raw)
    except _DECODE_ERRORS as exc:
        raise _validation_error("/tokenize response: tokens", exc) from exc
    if ids is None:
        raise MalformedResponseError("/tokenize response has no 'tokens' list")
    return ids


class DecodedResponse:
    """A chat completion with its token fields held back for typed decoding.

    ``body`` is the response as plain JSON without the token transport fields; ``choices`` is
    ``body["choices"]`` and ``messages[i]`` is ``choices[i]["message"]`` (the same objects). The
    token fields are read by name (``"prompt_token_ids"``, ``"choices[1].token_ids"``) through
    ``token_ids``, ``log_probs`` and ``logprob_tokens``.
    """

    __slots__ = ("_decoded", "_logprob_tokens", "_raw", "body", "choices", "messages")

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]], raw: dict[str, msgspec.Raw]) -> None:
        self.body = body
        self.choices: list[dict[str, Any]] = body["choices"]
        self.messages = messages
        self._raw = raw
        self._decoded: dict[str, Any] = {}
        self._logprob_tokens: dict[int, tuple[list[int], list[float]] | None] = {}

    def _typed(self, field: str, decoder: msgspec.json.Decoder[Any]) -> Any:
        if field in self._decoded:
            return self._decoded[field]
        raw = self._raw.get(field)
        try:
            value = None if raw is None else decoder.decode(raw)
        except _DECODE_ERRORS as exc:
            raise _validation_error(field, exc) from exc
        self._decoded[field] = value
        return value

    def token_ids(self, field: str) -> list[int] | None:
        """The ids at ``field`` (e.g. ``"prompt_token_ids"``, ``"choices[0].token_ids"``); None if absent or null."""
        value: list[int] | None = self._typed(field, _ids)
        return value

    def log_probs(self, field: str) -> list[float] | None:
        value: list[float] | None = self._typed(field, _floats)
        return value

    def logprob_entries(self, index: int = 0) -> list[Any] | None:
        """The entries of ``choices[index].logprobs.content`` (``.token``, ``.logprob``), or None if absent."""
        logprobs: _Logprobs | None = self._typed(f"choices[{index}].logprobs", _logprobs)
        return None if logprobs is None else logprobs.content

    def completion_logprobs(self, index: int = 0) -> tuple[list[str], list[float]] | None:
        """``choices[index].logprobs`` of a ``/v1/completions`` answer: its tokens and log probabilities."""
        logprobs: _CompletionLogprobs | None = self._typed(f"choices[{index}].logprobs", _completion_logprobs)
        return None if logprobs is None else (logprobs.tokens, logprobs.token_logprobs)

    def logprob_tokens(self, index: int = 0) -> tuple[list[int], list[float]] | None:
        """Generation ids and log probabilities from ``choices[index].logprobs.content``; None if absent.

        Tokens must read ``token_id:<int>`` (the request asks for ``return_tokens_as_token_ids``);
        otherwise ``MalformedTokenMetadataError`` names the first one that does not.
        """
        if index in self._logprob_tokens:
            return self._logprob_tokens[index]
        entries = self.logprob_entries(index)
        result: tuple[list[int], list[float]] | None = None
        if entries is not None:
            where = f"choices[{index}].logprobs.content[{{}}].token"
            result = (token_ids_of([entry.token for entry in entries], where), [entry.logprob for entry in entries])
        self._logprob_tokens[index] = result
        return result

    def present(self, field: str) -> bool:
        """Whether a held-back token field was sent with a value other than null."""
        raw = self._raw.get(field)
        return raw is not None and not (len(raw) == 4 and bytes(raw) == b"null")


def token_ids_of(tokens: list[str], field: str) -> list[int]:
    """The ids of tokens written ``token_id:<int>``; ``MalformedTokenMetadataError`` naming the first that is
    not (``field`` with ``{}`` where its position goes)."""
    joined = "\n".join(tokens)
    # A token holding a newline would pass the pattern as two lines: count them too.
    if tokens and (_TOKEN_LINES.fullmatch(joined) is None or joined.count("\n") != len(tokens) - 1):
        raise _bad_token(tokens, field)
    ids = [int(token[9:]) for token in tokens]
    if ids and max(ids) > MAX_TOKEN_ID:
        raise _bad_token(tokens, field)
    return ids


def _bad_token(tokens: list[str], field: str) -> MalformedTokenMetadataError:
    for position, token in enumerate(tokens):
        if _TOKEN.fullmatch(token) is None or int(token[len(_TOKEN_PREFIX) :]) > MAX_TOKEN_ID:
            return MalformedTokenMetadataError(
                f"{field.format(position)}: {token[:40]!r} is not 'token_id:<int>' with an "
                f"id from 0 to {MAX_TOKEN_ID:,}; request return_tokens_as_token_ids=true (TokenClient does)"
            )
    raise AssertionError("unreachable: the joined tokens failed the pattern, so one token does")  # pragma: no cover


# How a failure to decode an object is told: (too deeply nested, JSON but not an object, not JSON),
# each formatted with ``what`` and msgspec's own words ``exc``, only when it happens.
_FIELD_PHRASES = (
    "{what}: JSON nested too deeply",
    "{what}: expected an object ({exc})",
    "{what}: expected an object ({exc})",
)
_CHAT_PHRASES = (
    "{what} is JSON nested too deeply to be a chat completion",
    "{what} is not a JSON object: {exc}",
    "{what} is not valid JSON: {exc}",
)


def object_fields(
    raw: msgspec.Raw | bytes | str,
    what: str,
    error: type[MalformedResponseError],
    phrases: tuple[str, str, str] = _FIELD_PHRASES,
) -> dict[str, msgspec.Raw]:
    """``raw`` as an object of raw fields, or ``error`` saying what ``what`` is not (``phrases``)."""
    try:
        fields: dict[str, msgspec.Raw] = _fields.decode(raw)
    except RecursionError as exc:
        raise error(phrases[0].format(what=what, exc=exc)) from exc
    except msgspec.ValidationError as exc:
        raise error(phrases[1].format(what=what, exc=exc)) from exc
    except msgspec.DecodeError as exc:
        raise error(phrases[2].format(what=what, exc=exc)) from exc
    return fields


def _split(
    fields: dict[str, msgspec.Raw], held: frozenset[str], prefix: str, raw: dict[str, msgspec.Raw]
) -> dict[str, Any]:
    """Decode ``fields`` as plain JSON except the ``held`` ones, kept raw under ``prefix + key``."""
    decoded: dict[str, Any] = {}
    for key, value in fields.items():
        if key in held:
            raw[prefix + key] = value
        else:
            decoded[key] = _generic(value, prefix + key)
    return decoded


def decode_response(data: bytes | str) -> DecodedResponse:
    """Decode a chat completion body; token fields are kept raw for typed decoding later."""
    top = object_fields(data, "the response", MalformedResponseError, _CHAT_PHRASES)
    if "choices" not in top:
        raise MalformedResponseError("the response has no 'choices'; is this a chat completion response?")
    raw: dict[str, msgspec.Raw] = {}
    nvext = top.pop("nvext", None)
    choices_raw = top.pop("choices")
    body = _split(top, _TOP_RAW, "", raw)
    if nvext is not None:
        body["nvext"] = _nvext(nvext, raw)
    try:
        choices = _choices.decode(choices_raw)
    except _DECODE_ERRORS as exc:
        raise MalformedResponseError(f"choices: expected a list of objects ({exc or 'nested too deeply'})") from exc
    if not choices:
        raise MalformedResponseError("choices: the list is empty; the server returned no completion")
    decoded_choices: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for index, choice_fields in enumerate(choices):
        prefix = f"choices[{index}]."
        message_raw = choice_fields.pop("message", None)
        choice = _split(choice_fields, _CHOICE_RAW, prefix, raw)
        message = (
            {}
            if message_raw is None
            else _split(
                object_fields(message_raw, prefix + "message", MalformedResponseError),
                _MESSAGE_RAW,
                prefix + "message.",
                raw,
            )
        )
        choice["message"] = message
        decoded_choices.append(choice)
        messages.append(message)
    body["choices"] = decoded_choices
    return DecodedResponse(body, messages, raw)


def _nvext(value: msgspec.Raw, raw: dict[str, msgspec.Raw]) -> Any:
    """Dynamo's ``nvext``: its ``engine_data`` token fields are held raw, the rest decoded."""
    try:
        fields: dict[str, msgspec.Raw] = _fields.decode(value)
    except _DECODE_ERRORS:
        return _generic(value, "nvext")  # not an object: nothing of ours in it (or not JSON: that error)
    engine_data = fields.pop("engine_data", None)
    nvext = {key: _generic(item, f"nvext.{key}") for key, item in fields.items()}
    if engine_data is not None:
        engine_fields = object_fields(engine_data, "nvext.engine_data", MalformedTokenMetadataError)
        rest = _split(engine_fields, _ENGINE_DATA_RAW, "nvext.engine_data.", raw)
        if rest:
            nvext["engine_data"] = rest
    return nvext
