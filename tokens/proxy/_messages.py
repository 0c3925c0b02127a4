"""Anthropic Messages to and from chat completions, as pure functions.

vLLM's own ``/v1/messages`` carries no token ids, so a Messages request is served as a chat
completion: ``messages_to_chat`` converts the request (``system``, ``content`` blocks of text,
images, ``tool_use`` and ``tool_result``), ``chat_to_messages`` the captured answer, and
``MessagesEvents`` a stream, chunk by chunk. The bundle rides on the answer's top level as
``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs`` (the ``anthropic`` SDK
keeps unknown fields on the parsed ``Message``); in a stream, on the ``message_delta`` event.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._stream import reasoning_of
from ._chat import HOLE, TOKEN_FIELDS, SSETemplate, function_tool, required_string, sse, text_parts
from ._errors import ProxyError, RequestRejectedError, UpstreamError, anthropic_error_body

__all__ = ["MessagesEvents", "chat_to_messages", "messages_to_chat"]

_TEXT = frozenset({"text"})
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_PASSED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}


def messages_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request for an Anthropic Messages request."""
    if not isinstance(body.get("max_tokens"), int):
        raise RequestRejectedError("max_tokens: required, an integer", param="max_tokens")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise RequestRejectedError("messages: must be a non-empty list", param="messages")
    messages: list[dict[str, Any]] = []
    system: list[Any] = []
    if body.get("system"):
        system.append(text_parts(body["system"], "system", text_types=_TEXT))
    for index, message in enumerate(given):
        if isinstance(message, dict) and message.get("role") == "system":  # folded into the leading system
            system.append(text_parts(message.get("content", ""), f"messages[{index}].content", text_types=_TEXT))
        else:
            _add_message(messages, message, f"messages[{index}]")
    if system:
        messages.insert(0, {"role": "system", "content": _folded(system)})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": body["max_tokens"]}
    for name, chat_name in _PASSED.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if body.get("stream"):
        chat["stream"] = True
    return chat


def _folded(contents: list[Any]) -> Any:
    """System contents (each a string or text parts) as one system message's content: a string stays
    one, several become text parts, in order."""
    if len(contents) == 1:
        return contents[0]
    parts: list[Any] = []
    for content in contents:
        parts += [{"type": "text", "text": content}] if isinstance(content, str) else content
    return parts


def _add_message(messages: list[dict[str, Any]], message: Any, where: str) -> None:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise RequestRejectedError(f"{where}.role: must be 'user', 'assistant' or 'system'", param="messages")
    content = message.get("content")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise RequestRejectedError(f"{where}.content: must be a string or a list of blocks", param="messages")
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    results = 0
    first = len(messages)
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{index}]"
        if kind == "tool_result" and role == "user":  # each result is a tool message, before the user's text
            call_id = required_string(block, "messages", "tool_use_id", at)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _result(block, at)})
            results += 1
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            name = required_string(block, "messages", "name", at)
            calls.append(
                {
                    "id": required_string(block, "messages", "id", at),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "thinking" and role == "assistant":  # the model's reasoning: its reasoning_content
            if isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing an upstream can read
        else:
            parts.append(block)
    if parts or not (calls or results):
        text = text_parts(parts, f"{where}.content", text_types=_TEXT, image="image")
        messages.append({"role": role, "content": text})
    if calls:
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
            messages[-1]["tool_calls"] = calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    if thoughts:
        answer = next((m for m in messages[first:] if m["role"] == "assistant"), messages[-1])
        answer["reasoning_content"] = "".join(thoughts)
        if answer["content"] == []:
            answer["content"] = ""


def _result(block: Mapping[str, Any], where: str) -> Any:
    content = block.get("content", "")
    result = content if isinstance(content, str) else text_parts(content, f"{where}.content", text_types=_TEXT)
    if block.get("is_error") and isinstance(result, str):
        return f"Error: {result}"
    return result


def _client_tool(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") in (None, "custom")


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat tools of a Messages request: its client tools (name, input_schema); server tools and
    Anthropic-defined tools (``web_search_*``, ``bash_*``, ...) are left out (``dropped_tools``)."""
    given = body.get("tools")
    if given is None:
        return []
    if not isinstance(given, list):
        raise RequestRejectedError("tools: must be a list of tools", param="tools")
    tools = []
    for index, tool in enumerate(given):
        if _client_tool(tool):
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise RequestRejectedError(f"tools[{index}]: a client tool needs a name", param="tools")
            tools.append(function_tool(tool["name"], tool.get("description"), tool.get("input_schema")))
    return tools


def dropped_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's tools not sent upstream, each ``{"where", "type", "reason"}``."""
    given = body.get("tools")
    return [
        {
            "where": f"tools[{index}]",
            "type": str(tool.get("type") if isinstance(tool, dict) else None),
            "reason": "a server tool or an Anthropic-defined tool: the upstream serves client tools only",
        }
        for index, tool in enumerate(given if isinstance(given, list) else [])
        if not _client_tool(tool)
    ]


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestRejectedError(f"tool_choice: {choice!r} is not served (auto, any, none or tool)", param="tool_choice")


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {"_unparsed_arguments": text}  # the model wrote invalid JSON: kept, not dropped


def _usage(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}


def chat_to_messages(completion: Mapping[str, Any]) -> dict[str, Any]:
    """The Anthropic Messages answer for a captured chat completion (its first choice)."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id", ""),
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments", "")),
            }
        )
    answer: dict[str, Any] = {
        "id": f"msg_{completion.get('id', '')}",
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": _STOP.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(completion.get("usage")),
    }
    answer.update({name: message[name] for name in TOKEN_FIELDS if name in message})
    return answer


@dataclass
class _Block:
    index: int
    kind: str
    delta: SSETemplate
    """The block's ``content_block_delta`` event, its text left open."""


_DELTAS = {
    "thinking": ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
    "tool_use": ("input_json_delta", "partial_json"),
}
"""Each block type's delta: its type and the field that carries its text."""


@dataclass
class MessagesEvents:
    """The Anthropic stream for a captured chat completion stream: ``feed(chunk)`` per chat chunk,
    then ``finish()``; each returns the SSE bytes to send (constant work per chunk)."""

    _started: bool = False
    _blocks: int = 0
    _open: _Block | None = None
    _calls: dict[int, _Block] = field(default_factory=dict)
    _finish: Any = None
    _usage: Any = None
    _bundles: Any = None

    def start(self) -> list[bytes]:
        return []  # ``message_start`` waits for the first chunk (it carries the answer's id and model)

    def error(self, error: ProxyError) -> bytes:
        return sse(anthropic_error_body(error), "error")

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self._started:
            self._started = True
            prompt = chunk.get("prompt_token_ids")
            usage = {"input_tokens": len(prompt) if isinstance(prompt, list) else 0, "output_tokens": 0}
            start: dict[str, Any] = {
                "id": f"msg_{chunk.get('id', '')}",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk.get("model"),
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            }
            out.append(sse({"type": "message_start", "message": start}, "message_start"))
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        if chunk.get("token_bundles"):
            self._bundles = chunk["token_bundles"][0]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                if self._open is None or self._open.kind != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta(reasoning))
            if delta.get("content"):
                if self._open is None or self._open.kind != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return out

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        kind, name = _DELTAS[block["type"]]
        delta = {"type": "content_block_delta", "index": self._blocks, "delta": {"type": kind, name: HOLE}}
        self._open = _Block(self._blocks, block["type"], SSETemplate(delta, "content_block_delta"))
        self._blocks += 1
        out.append(
            sse(
                {"type": "content_block_start", "index": self._open.index, "content_block": block},
                "content_block_start",
            )
        )
        return out

    def _delta(self, text: str) -> bytes:
        assert self._open is not None
        return self._open.delta(text)

    def _stop(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open.index, None
        return [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def _call(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        function = call.get("function") or {}
        if position not in self._calls:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": {},
            }
            out += self._start(block)
            assert self._open is not None
            self._calls[position] = self._open
        if function.get("arguments"):
            if self._open is not self._calls[position]:
                raise UpstreamError(
                    "the upstream's stream interleaves the arguments of two tool calls, which the "
                    "Messages stream cannot carry"
                )
            out.append(self._delta(function["arguments"]))
        return out

    def finish(self) -> list[bytes]:
        """``content_block_stop``, ``message_delta`` (stop reason, usage, the bundle) and ``message_stop``."""
        out = self._stop()
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP.get(self._finish, "end_turn"), "stop_sequence": None},
            "usage": {"output_tokens": _usage(self._usage)["output_tokens"]},
        }
        if self._bundles is not None:
            delta.update({name: self._bundles[name] for name in TOKEN_FIELDS if name in self._bundles})
        out += [sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]
        return out
