"""Pieces the dialect conversions share: SSE framing, and the bundle fields carried on an answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from .._vllm_responses import TOKEN_FIELDS
from .._vllm_responses import without_token_fields as strip_token_fields
from ._errors import RequestRejectedError

__all__ = [
    "HOLE",
    "TOKEN_FIELDS",
    "SSETemplate",
    "function_tool",
    "required_string",
    "sse",
    "strip_token_fields",
    "text_parts",
    "without_echoes",
]

_encode = msgspec.json.Encoder().encode


def sse(data: Mapping[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: ``event: <event>`` (when given) and one ``data:`` line of JSON."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + _encode(data) + b"\n\n"


HOLE = "\x00"
"""The value that marks an ``SSETemplate``'s holes (no event a stream makes carries it)."""
_HOLE = _encode(HOLE)


class SSETemplate:
    """A kind of server-sent event whose data differs from one event to the next only in a few
    values (a stream's deltas): encoded once by ``sse`` with those values ``HOLE``, each event is
    then the template with its values encoded into the holes, in order: the same bytes as ``sse``
    of the whole data, for a fraction of the work."""

    def __init__(self, data: Mapping[str, Any], event: str | None = None) -> None:
        self.parts = sse(data, event).split(_HOLE)

    def __call__(self, *values: Any) -> bytes:
        parts = self.parts
        pieces = [parts[0]]
        for value, part in zip(values, parts[1:], strict=True):
            pieces += (_encode(value), part)
        return b"".join(pieces)


def without_echoes(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion request without the bundles the proxy added to earlier answers, wherever a
    client library echoes them on its messages (``strip_token_fields``): they never travel upstream."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    cleaned = [strip_token_fields(message) for message in messages]
    if all(new is old for new, old in zip(cleaned, messages, strict=True)):
        return body
    return {**body, "messages": cleaned}


def required_string(item: Mapping[str, Any], param: str, name: str, where: str) -> str:
    """``item[name]``, which must be a string (``RequestRejectedError`` naming ``where`` otherwise)."""
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestRejectedError(f"{where}.{name}: must be a string", param=param)
    return value


def function_tool(name: str, description: Any, parameters: Any) -> dict[str, Any]:
    """A chat completions function tool (parameters default to an empty object schema)."""
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def text_parts(content: Any, where: str, *, text_types: frozenset[str], image: str | None = None) -> Any:
    """Content as chat completions take it: a string stays one; a list of parts of ``text_types``
    becomes chat text parts (one part: its string), an ``image`` part an ``image_url`` part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestRejectedError(f"{where}: content must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in text_types and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind is not None and kind == image:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, f"{where}[{index}]")}})
        else:
            raise RequestRejectedError(
                f"{where}[{index}]: a part of type {kind!r} cannot be sent to chat completions (text "
                f"{'and images ' if image else ''}only)",
                param=where,
            )
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _image_url(part: Mapping[str, Any], where: str) -> str:
    url = part.get("image_url")
    if isinstance(url, str):
        return url
    source = part.get("source")  # Anthropic: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    if isinstance(source, dict):
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return str(source["url"])
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    raise RequestRejectedError(f"{where}: an image needs an image_url or a url / base64 source", param=where)
