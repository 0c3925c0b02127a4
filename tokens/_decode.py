"""Decoding a chat completion for token extraction, fast at 128K-token lengths.

The response is scanned once into raw slices; the token fields (the large part) are decoded
straight into typed lists by msgspec, which rejects booleans for ints, non-numbers for log
probabilities and non-finite numbers, and everything else is decoded as plain JSON. The token
fields are decoded only when an extraction step asks for them, and at most once.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from ._errors import MalformedTokenMetadataError, TokenCaptureError

__all__ = ["DecodedResponse", "MalformedResponseError", "decode_response"]


class MalformedResponseError(TokenCaptureError):
    """The response body is not a chat completion (not JSON, not an object, no choices)."""


MalformedResponseError.__module__ = "tokens"

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class _LogprobEntry(msgspec.Struct):
    token: str
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_LogprobEntry] | None = None


_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_ids = msgspec.json.Decoder(list[TokenId] | None)
_floats = msgspec.json.Decoder(list[float] | None)
_logprobs = msgspec.json.Decoder(_Logprobs | None)
_any = msgspec.json.Decoder()

_TOKEN_PREFIX = "token_id:"
_TOKEN_LINES = re.compile(r"token_id:[0-9]+(?:\ntoken_id:[0-9]+)*")

# Fields held raw until an extraction step decodes them typed, by container.
_TOP_RAW = frozenset({"prompt_token_ids"})  # vLLM
_CHOICE_RAW = frozenset({"token_ids", "logprobs", "prompt_token_ids"})  # vLLM, SGLang (prompt ids on the choice)
_MESSAGE_RAW = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})  # NeMo RL
_ENGINE_DATA_RAW = frozenset({"prompt_token_ids", "completion_token_ids", "completion_logprobs"})  # Dynamo


def _validation_error(field: str, exc: msgspec.MsgspecError) -> MalformedTokenMetadataError:
    message, _, path = str(exc).partition(" - at `")
    where = field + path.rstrip("`")[1:] if path else field
    return MalformedTokenMetadataError(f"{where}: {message}")


def _generic(raw: msgspec.Raw, field: str) -> Any:
    try:
        return _any.decode(raw)
    except msgspec.MsgspecError as exc:  # the raw scan does not check what is inside strings (UTF-8)
        raise MalformedResponseError(f"{field}: {exc}") from exc


class DecodedResponse:
    """A chat completion with its token fields held back for typed decoding.

    ``body`` is the response as plain JSON without the token transport fields; ``choice`` is
    ``body["choices"][0]`` and ``message`` is ``choice["message"]`` (the same objects). The token
    fields are read through ``token_ids``, ``log_probs`` and ``logprob_tokens``.
    """

    __slots__ = ("_decoded", "_logprob_tokens", "_raw", "body", "choice", "logprobs_verified", "message")

    def __init__(self, body: dict[str, Any], choice: dict[str, Any], message: dict[str, Any],
                 raw: dict[str, msgspec.Raw]) -> None:  # fmt: skip
        self.body = body
        self.choice = choice
        self.message = message
        self._raw = raw
        self._decoded: dict[str, Any] = {}
        self.logprobs_verified = False
        """Set once a source compared the logprob token ids with the generation it offered."""
        self._logprob_tokens: tuple[list[int], list[float]] | bool | None = False

    def _typed(self, field: str, decoder: msgspec.json.Decoder[Any]) -> Any:
        if field in self._decoded:
            return self._decoded[field]
        raw = self._raw.get(field)
        try:
            value = None if raw is None else decoder.decode(raw)
        except msgspec.MsgspecError as exc:
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

    def logprob_entries(self) -> list[Any] | None:
        """The entries of ``choices[0].logprobs.content`` (``.token``, ``.logprob``), or None if absent."""
        logprobs: _Logprobs | None = self._typed("choices[0].logprobs", _logprobs)
        return None if logprobs is None else logprobs.content

    def logprob_tokens(self) -> tuple[list[int], list[float]] | None:
        """Generation ids and log probabilities from ``choices[0].logprobs.content``; None if absent.

        Tokens must read ``token_id:<int>`` (the request asks for ``return_tokens_as_token_ids``);
        otherwise ``MalformedTokenMetadataError`` names the first one that does not.
        """
        cached = self._logprob_tokens
        if cached is not False:
            return cached  # type: ignore[return-value]
        entries = self.logprob_entries()
        result: tuple[list[int], list[float]] | None = None
        if entries is not None:
            tokens = [entry.token for entry in entries]
            if tokens and _TOKEN_LINES.fullmatch("\n".join(tokens)) is None:
                raise _bad_token(tokens)
            result = ([int(token[9:]) for token in tokens], [entry.logprob for entry in entries])
        self._logprob_tokens = result
        return result

    def present(self, field: str) -> bool:
        """Whether a held-back token field was sent with a value other than null."""
        raw = self._raw.get(field)
        return raw is not None and not (len(raw) == 4 and bytes(raw) == b"null")


def _bad_token(tokens: list[str]) -> MalformedTokenMetadataError:
    for index, token in enumerate(tokens):
        digits = token[len(_TOKEN_PREFIX) :]
        if not (token.startswith(_TOKEN_PREFIX) and digits.isascii() and digits.isdigit()):
            return MalformedTokenMetadataError(
                f"choices[0].logprobs.content[{index}].token: {token[:40]!r} is not 'token_id:<int>'; "
                "request return_tokens_as_token_ids=true (TokenClient does)"
            )
    return MalformedTokenMetadataError("choices[0].logprobs.content: a token is not 'token_id:<int>'")


def _object(
    raw: msgspec.Raw, field: str, error: type[TokenCaptureError] = MalformedResponseError
) -> dict[str, msgspec.Raw]:
    """``raw`` as an object of raw fields, or ``error`` naming ``field``."""
    try:
        fields: dict[str, msgspec.Raw] = _fields.decode(raw)
    except msgspec.MsgspecError as exc:
        raise error(f"{field}: expected an object ({exc})") from exc
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
    try:
        top = _fields.decode(data)
    except msgspec.ValidationError as exc:
        raise MalformedResponseError(f"the response is not a JSON object: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedResponseError(f"the response is not valid JSON: {exc}") from exc
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
    except msgspec.MsgspecError as exc:
        raise MalformedResponseError(f"choices: expected a list of objects ({exc})") from exc
    if not choices:
        raise MalformedResponseError("choices: the list is empty; the server returned no completion")
    message_raw = choices[0].pop("message", None)
    first = _split(choices[0], _CHOICE_RAW, "choices[0].", raw)
    message = (
        {}
        if message_raw is None
        else _split(_object(message_raw, "choices[0].message"), _MESSAGE_RAW, "choices[0].message.", raw)
    )
    first["message"] = message
    others = [
        {key: _generic(value, f"choices[{n}].{key}") for key, value in c.items()} for n, c in enumerate(choices[1:], 1)
    ]
    body["choices"] = [first, *others]
    return DecodedResponse(body, first, message, raw)


def _nvext(value: msgspec.Raw, raw: dict[str, msgspec.Raw]) -> Any:
    """Dynamo's ``nvext``: its ``engine_data`` token fields are held raw, the rest decoded."""
    try:
        fields: dict[str, msgspec.Raw] = _fields.decode(value)
    except msgspec.MsgspecError:
        return _generic(value, "nvext")  # not an object: nothing of ours in it (or not JSON: that error)
    engine_data = fields.pop("engine_data", None)
    nvext = {key: _generic(item, f"nvext.{key}") for key, item in fields.items()}
    if engine_data is not None:
        engine_fields = _object(engine_data, "nvext.engine_data", MalformedTokenMetadataError)
        rest = _split(engine_fields, _ENGINE_DATA_RAW, "nvext.engine_data.", raw)
        if rest:
            nvext["engine_data"] = rest
    return nvext
