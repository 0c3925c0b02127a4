"""Continuation fingerprints: how a request is matched to the recorded call it continues.

NeMo Gym's lineage layout (fingerprint version 2), computed here from its definition so records
stamped by either side resolve on the other: ``assistant_fingerprint`` hashes the model-authored
turns of a message list (the lookup key: the last of them names the call that wrote it);
``conversation_digest`` hashes every turn, tool results included (a rewritten, summarized or
truncated history fails verification). Chat, Responses and Anthropic shapes give the same hash
input. Every field is tagged and length-delimited.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = ["FINGERPRINT_VERSION", "assistant_fingerprint", "conversation_digest"]

FINGERPRINT_VERSION = 2
_FINGERPRINT_DOMAIN = b"nemo-gym-lineage"
_CONTEXT_DOMAIN = b"nemo-gym-lineage-context"
_TEXT_BLOCKS = frozenset({"", "text", "input_text", "output_text"})


def _canonical(value: Any) -> str:
    """Sorted-key compact JSON (the layout orjson's OPT_SORT_KEYS writes)."""
    try:
        return msgspec.json.encode(value, order="sorted").decode("utf-8")
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"unsupported prompt content: {type(value).__name__}") from exc


def _arguments(value: Any) -> str:
    """Tool-call arguments for comparison: re-serialized sorted-key JSON, so a harness that
    re-serializes them between turns still matches."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            text: str = value
            return text.strip()
    return _canonical(value)


def _field(hasher: Any, tag: bytes, value: str) -> None:
    data = value.encode("utf-8")
    hasher.update(tag + len(data).to_bytes(8, "big") + data)


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ValueError(f"request item is not an object: {type(item).__name__}")
    return item


def _parts(content: Any) -> list[tuple[str, str]]:
    """Typed content parts; tool calls and results are read separately."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, list):
        raise ValueError(f"unsupported message content: {type(content).__name__}")
    parts: list[tuple[str, str]] = []
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, dict):
            raise ValueError(f"unsupported content block: {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in ("tool_use", "tool_result"):
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_BLOCKS:
            if text:
                parts.append(("text", text))
            continue
        if not kind:
            raise ValueError("content block has no supported type")
        parts.append((kind, _canonical(block)))
    return parts


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` of a Responses ``function_call`` item, Anthropic ``tool_use``
    blocks and Chat ``tool_calls``."""
    calls: list[tuple[str, str, str]] = []
    if message.get("type") == "function_call":
        name = str(message.get("name", ""))
        if message.get("namespace"):
            name = f"{message['namespace']}__{name}"
        calls.append(
            (str(message.get("call_id") or message.get("id") or ""), name, _arguments(message.get("arguments")))
        )
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                calls.append((str(block.get("id") or ""), str(block.get("name", "")), _arguments(block.get("input"))))
    for call in message.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        calls.append(
            (str((call or {}).get("id") or ""), str(function.get("name", "")), _arguments(function.get("arguments")))
        )
    return calls


def _tool_results(message: dict[str, Any]) -> list[tuple[str, str]]:
    results: list[tuple[str, str]] = []

    def text(value: Any) -> str:
        return value if isinstance(value, str) else _canonical(value)

    if message.get("type") == "function_call_output":
        results.append((str(message.get("call_id") or message.get("id") or ""), text(message.get("output"))))
    elif message.get("role") == "tool":
        results.append((str(message.get("tool_call_id") or ""), text(message.get("content"))))
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                results.append((str(block.get("tool_use_id") or block.get("id") or ""), text(block.get("content"))))
    return results


def _content_and_calls(hasher: Any, message: dict[str, Any], first_tag: int) -> None:
    """A turn's content parts, then its tool calls, as tagged fields: tags ``first_tag`` onwards."""
    tags = [bytes([first_tag + offset]) for offset in range(5)]
    for kind, payload in _parts(message.get("content")):
        _field(hasher, tags[0], kind)
        _field(hasher, tags[1], payload)
    for call_id, name, arguments in _tool_calls(message):
        _field(hasher, tags[2], call_id)
        _field(hasher, tags[3], name)
        _field(hasher, tags[4], arguments)


def assistant_fingerprint(messages: Iterable[Any]) -> str:
    """The model-authored turns (role ``assistant``, Responses ``function_call`` items), in order;
    "" when there are none (the request is a root). Reasoning items are left out on purpose."""
    hasher = hashlib.sha256(_FINGERPRINT_DOMAIN)
    authored = 0
    for item in messages:
        message = _message(item)
        if message.get("role") != "assistant" and message.get("type") != "function_call":
            continue
        authored += 1
        _content_and_calls(hasher, message, 0)
    return hasher.hexdigest() if authored else ""


def conversation_digest(messages: Iterable[Any]) -> str:
    """Every turn of a conversation: roles, content, tool calls and tool results."""
    hasher = hashlib.sha256(_CONTEXT_DOMAIN)
    for item in messages:
        message = _message(item)
        _field(hasher, b"\x00", str(message.get("role") or message.get("type") or ""))
        _content_and_calls(hasher, message, 1)
        for call_id, output in _tool_results(message):
            _field(hasher, b"\x06", call_id)
            _field(hasher, b"\x07", output)
    return hasher.hexdigest()
