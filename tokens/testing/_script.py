"""A served fake's script: its settings and the answers it gives, in order (a JSON file, or options).

A script file is a JSON object; every key is optional::

    {"model": "tiny", "max_model_len": 2048, "stream_delay_s": 0.05,
     "replies": ["It is noon.",
                 {"tool_call": {"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}},
                 {"token_ids": [75, 107, 2], "logprobs": [-0.5, -0.25, -0.01]},
                 {"error": 503, "retry_after": 1}]}

Each reply answers the next choice generated (a text, or ``{"text": ...}``; a tool call; exact ids),
or the next chat or completions request (an error: ``message`` and ``retry_after`` optional). When
the replies are used up, the fake answers with texts of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import ScriptError
from ._fake_vllm import FakeTokenizer, FakeVLLM

__all__ = ["Script", "add_reply", "read_script"]

REPLY_KINDS: Mapping[str, frozenset[str]] = {
    "text": frozenset({"text"}),
    "tool_call": frozenset({"tool_call"}),
    "token_ids": frozenset({"token_ids", "logprobs"}),
    "error": frozenset({"error", "message", "retry_after"}),
}
"""Each reply's one kind key, and every key a reply of that kind may have."""
SETTINGS = frozenset({"model", "max_model_len", "stream_delay_s", "replies"})
MAX_STREAM_DELAY_S = 60.0


@dataclass
class Script:
    """What a served fake answers (``fake``, its replies queued) and the pause between the events of a
    stream (``stream_delay_s``)."""

    fake: FakeVLLM = field(default_factory=FakeVLLM)
    stream_delay_s: float = 0.0


def read_script(path: str | Path) -> Script:
    """The script in the JSON file at ``path``; ``ScriptError`` naming the file (and the entry) when it
    cannot be read or used."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ScriptError(f"{where}: cannot read the script: {reason}; give the path of a JSON script file") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ScriptError(
            f'{where}: not JSON ({exc}); a script is a JSON object such as {{"replies": ["It is noon."]}}'
        ) from None
    return parse_script(data, where)


def parse_script(data: Any, where: str) -> Script:
    """A script from its decoded JSON (``where`` names it in errors)."""
    if not isinstance(data, dict):
        raise ScriptError(f"{where}: a script is a JSON object (keys {_names(SETTINGS)}), not {_kind(data)}")
    unknown = sorted(set(data) - SETTINGS)
    if unknown:
        raise ScriptError(f"{where}: unknown key {unknown[0]!r}; a script's keys are {_names(SETTINGS)}")
    script = Script(FakeVLLM(), _number(data.get("stream_delay_s", 0.0), f"{where}: stream_delay_s"))
    if script.stream_delay_s > MAX_STREAM_DELAY_S:
        raise ScriptError(
            f"{where}: stream_delay_s is {script.stream_delay_s:g}; give at most {MAX_STREAM_DELAY_S:g} s"
        )
    model = data.get("model", script.fake.model)
    if not isinstance(model, str) or not model:
        raise ScriptError(f"{where}: model must be a non-empty string (the name /v1/models lists), not {_kind(model)}")
    script.fake.model = model
    length = data.get("max_model_len", script.fake.max_model_len)
    if type(length) is not int or length < 1:
        raise ScriptError(f"{where}: max_model_len must be a positive integer (tokens), not {length!r}")
    script.fake.max_model_len = length
    replies = data.get("replies", [])
    if not isinstance(replies, list):
        raise ScriptError(f"{where}: replies must be a list of replies, not {_kind(replies)}")
    for index, entry in enumerate(replies):
        add_reply(script.fake, entry, f"{where}: replies[{index}]")
    return script


def add_reply(fake: FakeVLLM, entry: Any, where: str) -> None:
    """Queue one reply of a script on ``fake`` (``ScriptError`` naming ``where`` when it is not one)."""
    if isinstance(entry, str):
        entry = {"text": entry}
    if not isinstance(entry, dict):
        raise ScriptError(
            f"{where}: a reply is a text or an object with one of {_names(REPLY_KINDS)}, not {_kind(entry)}"
        )
    kinds = [key for key in REPLY_KINDS if key in entry]
    if len(kinds) != 1:
        raise ScriptError(
            f"{where}: a reply has exactly one of {_names(REPLY_KINDS)}; this one has "
            f"{_names(kinds) if kinds else 'none'}"
        )
    [kind] = kinds
    unknown = sorted(set(entry) - REPLY_KINDS[kind])
    if unknown:
        raise ScriptError(
            f"{where}: {unknown[0]!r} is not a key of a {kind} reply (its keys: {_names(REPLY_KINDS[kind])})"
        )
    if kind == "text":
        if not isinstance(entry["text"], str):
            raise ScriptError(f"{where}: text must be a string, not {_kind(entry['text'])}")
        fake.reply(entry["text"])
    elif kind == "tool_call":
        _add_tool_call(fake, entry["tool_call"], f"{where}: tool_call")
    elif kind == "token_ids":
        _add_tokens(fake, entry["token_ids"], entry.get("logprobs"), where)
    else:
        _add_error(fake, entry, where)


def _add_tool_call(fake: FakeVLLM, call: Any, where: str) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ScriptError(
            f'{where}: a tool call is {{"name": "get_time", "arguments": {{...}}}}, with the '
            "tool's name as a non-empty string"
        )
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict) or set(call) - {"name", "arguments"}:
        raise ScriptError(f"{where}: a tool call has a name and arguments (a JSON object) only")
    fake.reply_tool_call(call["name"], arguments)


def _add_tokens(fake: FakeVLLM, ids: Any, logprobs: Any, where: str) -> None:
    top = FakeTokenizer.VOCAB_SIZE - 1
    if not isinstance(ids, list) or not ids:
        raise ScriptError(f"{where}: token_ids must be a non-empty list of ids, not {_kind(ids)}")
    for index, token in enumerate(ids):
        if type(token) is not int or not 0 <= token <= top:
            raise ScriptError(
                f"{where}: token_ids[{index}] is {token!r}, not an id of the fake's tokenizer: give "
                f"0 to {top} (0 <pad>, 1 <|im_start|>, 2 <|im_end|>, then byte + 3)"
            )
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise ScriptError(f"{where}: logprobs must be a list of {len(ids)} numbers, one per token id")
        for index, value in enumerate(logprobs):
            if _number(value, f"{where}: logprobs[{index}]", minimum=-math.inf) > 0:
                raise ScriptError(f"{where}: logprobs[{index}] is {value!r}; a log probability is at most 0")
    fake.reply_tokens(ids, logprobs)


def _add_error(fake: FakeVLLM, entry: Mapping[str, Any], where: str) -> None:
    status = entry["error"]
    if type(status) is not int or not 400 <= status <= 599:
        raise ScriptError(f"{where}: error must be an HTTP status from 400 to 599, not {status!r}")
    message = entry.get("message")
    if message is not None and not isinstance(message, str):
        raise ScriptError(f"{where}: message must be a string, not {_kind(message)}")
    retry_after = entry.get("retry_after")
    if retry_after is not None:
        retry_after = _number(retry_after, f"{where}: retry_after")
    fake.reply_error(status, message, retry_after=retry_after)


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    """A finite JSON number of at least ``minimum`` (``-math.inf``: any)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not minimum <= value < math.inf
        or value == -math.inf
    ):
        bound = "a finite number" if minimum == -math.inf else f"a number of at least {minimum:g}"
        raise ScriptError(f"{where} must be {bound}, not {value!r}")
    return float(value)


def _names(keys: Any) -> str:
    return ", ".join(repr(key) for key in sorted(keys))


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")
