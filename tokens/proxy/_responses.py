"""The OpenAI Responses API to and from chat completions, as pure functions.

``responses_to_chat`` turns a Responses request (``input`` as a string or items: messages,
``function_call`` and ``function_call_output`` items, earlier output items echoed back) into a chat
completion request; ``chat_to_responses`` turns the captured chat completion into a Responses
answer, and ``ResponsesEvents`` does the same for a stream, chunk by chunk (constant work per
chunk). The bundle rides on the last output item as ``prompt_token_ids``, ``generation_token_ids``
and ``generation_log_probs`` (NeMo Gym's place for it); the ``openai`` SDK keeps such fields on the
parsed item (``item.model_extra``, or ``getattr``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._bundle import TokenBundle
from .._stream import reasoning_of
from .._vllm_responses import prepare_responses_request
from ._chat import (
    HOLE,
    TOKEN_FIELDS,
    SSETemplate,
    function_tool,
    required_string,
    sse,
    strip_token_fields,
    text_parts,
)
from ._errors import ProxyError, RequestRejectedError

__all__ = ["ResponsesEvents", "chat_to_responses", "input_items", "responses_to_chat"]

_TEXT = frozenset({"input_text", "output_text", "text", "refusal"})
# Sampling fields vLLM takes on chat completions as they are.
_PASSED = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "seed",
    "user",
    "top_k",
    "min_p",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "chat_template_kwargs",
)
_UNSERVED = {
    "background": "background responses",
    "conversation": "server-side conversations",
    "prompt": "stored prompt templates",
}


def _user_message(content: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


def input_items(body: Mapping[str, Any]) -> list[Any]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [_user_message(given)]
    if not isinstance(given, list):
        raise RequestRejectedError("input: must be a string or a list of items", param="input")
    return given


def responses_to_chat(body: Mapping[str, Any], history: Sequence[Any] = ()) -> dict[str, Any]:
    """The chat completion request for a Responses request; ``history`` holds the items of a
    ``previous_response_id`` chain (its inputs and outputs), resolved by the caller."""
    for name, what in _UNSERVED.items():
        if body.get(name):
            raise RequestRejectedError(f"{name}: {what} are not served by the capture proxy", param=name)
    chat: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for index, item in enumerate(history):
        _add_item(messages, item, f"previous_response_id's item [{index}]")
    for index, item in enumerate(input_items(body)):
        _add_item(messages, item, f"input[{index}]")
    chat["messages"] = messages
    for name in _PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        choice = _tool_choice(choice)
        if tools or not body.get("tools"):  # with every tool given left out, there is nothing to choose
            chat["tool_choice"] = choice
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stream"):
        chat["stream"] = True
    return chat


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise RequestRejectedError(f"{where}: an input item must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message" and "role" in item:
        role = item["role"]
        if role not in ("user", "assistant", "system", "developer"):
            raise RequestRejectedError(f"{where}: unknown role {role!r}", param="input")
        content = text_parts(item.get("content", ""), f"{where}.content", text_types=_TEXT, image="input_image")
        last = messages[-1] if messages else None
        if role == "assistant" and last is not None and _thought_only(last):  # the reasoning before it
            last["content"] = content
        else:
            messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        name = required_string(item, "input", "name", where)
        namespace = item.get("namespace")
        call = {
            "id": required_string(item, "input", "call_id", where),
            "type": "function",
            "function": {
                "name": flat_name(namespace, name) if isinstance(namespace, str) and namespace else name,
                "arguments": required_string(item, "input", "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # text and calls of one turn are one message
            last.setdefault("tool_calls", []).append(call)
            if last.get("content") == "":
                last["content"] = None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else text_parts(output, f"{where}.output", text_types=_TEXT)
        messages.append(
            {"role": "tool", "tool_call_id": required_string(item, "input", "call_id", where), "content": content}
        )
    elif kind == "reasoning":  # the model's earlier reasoning: the next assistant message's reasoning_content
        text = _reasoning_text(item)
        if text:
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
    else:
        raise RequestRejectedError(
            f"{where}: items of type {kind!r} are not served by the capture proxy", param="input"
        )


def _thought_only(message: Mapping[str, Any]) -> bool:
    """An assistant message that holds only reasoning so far (its text or calls come next)."""
    return message["role"] == "assistant" and "reasoning_content" in message and message.get("content") in ("", None) \
        and "tool_calls" not in message  # fmt: skip


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary (encrypted content is
    OpenAI's own and not readable: left out)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = [p.get("text") for p in _listed(item.get(key)) if isinstance(p, dict) and p.get("type") == kind]
        text = "".join(part for part in parts if isinstance(part, str))
        if text:
            return text
    return ""


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


NAMESPACE_SEPARATOR = "__"
"""A function ``f`` of a namespace tool group ``ns`` is the chat function ``ns__f`` (mapped back on the way out)."""


def flat_name(namespace: str, name: str) -> str:
    """The chat function name of function ``name`` in the namespace tool group ``namespace``."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _function(tool: Any, where: str) -> tuple[str, Any, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise RequestRejectedError(f"{where}: a function tool needs a name (a non-empty string)", param="tools")
    return tool["name"], tool.get("description"), tool.get("parameters")


def dropped_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's tools that are not sent upstream, each ``{"where", "type", "reason"}``: hosted tools
    (``web_search``, ``file_search``, ...: the upstream has no server-side tools) and non-function tools
    inside a namespace group."""
    dropped: list[dict[str, Any]] = []
    for index, tool in enumerate(_listed(body.get("tools"))):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            for inner, member in enumerate(_listed(tool.get("tools"))):
                member_kind = member.get("type") if isinstance(member, dict) else None
                if member_kind != "function":
                    dropped.append(_drop(f"tools[{index}].tools[{inner}]", member_kind))
        elif kind != "function":
            dropped.append(_drop(f"tools[{index}]", kind))
    return dropped


def _drop(where: str, kind: Any) -> dict[str, Any]:
    return {
        "where": where,
        "type": str(kind),
        "reason": "not a function tool (hosted or custom): the upstream serves functions",
    }


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat tools of a Responses request: its function tools, and the functions of each namespace
    group flattened (``flat_name``); hosted tools are left out (``dropped_tools`` says which)."""
    tools: list[dict[str, Any]] = []
    given = body.get("tools")
    if given is not None and not isinstance(given, list):
        raise RequestRejectedError("tools: must be a list of tools", param="tools")
    for index, tool in enumerate(_listed(given)):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            name, description, parameters = _function(tool, f"tools[{index}]")
            tools.append(function_tool(name, description, parameters))
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise RequestRejectedError(f"tools[{index}]: a namespace needs a name", param="tools")
            for inner, member in enumerate(_listed(tool.get("tools"))):
                if isinstance(member, dict) and member.get("type") == "function":
                    name, description, parameters = _function(member, f"tools[{index}].tools[{inner}]")
                    tools.append(function_tool(flat_name(namespace, name), description, parameters))
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise RequestRejectedError(
            f"tools: two tools are called {twice!r} once namespace groups are flattened "
            f"(namespace{NAMESPACE_SEPARATOR}name); rename one",
            param="tools",
        )
    return tools


def tool_names(request: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The flattened names of a request's namespaced functions, each to its ``(namespace, name)``."""
    found: dict[str, tuple[str, str]] = {}
    for tool in _listed(request.get("tools")):
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for member in _listed(tool.get("tools")):
                if isinstance(member, dict) and isinstance(member.get("name"), str):
                    found[flat_name(tool["name"], member["name"])] = (tool["name"], member["name"])
    return found


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        namespace = choice.get("namespace")
        name = flat_name(namespace, choice["name"]) if isinstance(namespace, str) and namespace else choice["name"]
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, dict) and choice.get("type") in ("allowed_tools", "auto"):
        return choice.get("mode", "auto") if choice.get("mode") in ("auto", "required") else "auto"
    raise RequestRejectedError(
        f"tool_choice: {choice!r} is not served (auto, none, required or a function)", param="tool_choice"
    )


def _format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestRejectedError(f"text.format: type {fmt['type']!r} is not served", param="text")


# -- answers ----------------------------------------------------------------------------------


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _response(
    request: Mapping[str, Any],
    response_id: str,
    created: int,
    model: Any,
    status: str,
    output: list[dict[str, Any]],
    usage: Any,
    finish_reason: Any = None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": list(request.get("tools") or []),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": _usage(usage),
        "user": request.get("user"),
        "store": request.get("store", True),
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str,
    status: str = "completed",
    names: Mapping[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A ``function_call`` item; a flattened namespaced name (``names``) back as its ``namespace`` and ``name``."""
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    if names and name in names:
        item["namespace"], item["name"] = names[name]
    item["status"] = status
    return item


def chat_to_responses(completion: Mapping[str, Any], request: Mapping[str, Any], response_id: str) -> dict[str, Any]:
    """The Responses answer for a captured chat completion (its first choice; its bundle on the last item)."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(_reasoning_item(f"rs_{response_id[5:]}", reasoning))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or not calls:
        output.append(_message_item(f"msg_{response_id[5:]}", content or ""))
    names = tool_names(request)
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        output.append(
            _call_item(
                f"fc_{response_id[5:]}_{index}",
                call.get("id", ""),
                function.get("name", ""),
                function.get("arguments", ""),
                names=names,
            )
        )
    output[-1].update({name: message[name] for name in TOKEN_FIELDS if name in message})
    return _response(
        request,
        response_id,
        completion.get("created", int(time.time())),
        completion.get("model"),
        "completed",
        output,
        completion.get("usage"),
        choice.get("finish_reason"),
    )


def history_of(request: Mapping[str, Any], answer: Mapping[str, Any]) -> list[Any]:
    """The items a turn adds to its ``previous_response_id`` chain: its request's input and its
    answer's output, without bundle fields (an echoed bundle is never sent upstream, nor kept)."""
    return [strip_token_fields(item) for item in (*input_items(request), *answer.get("output", ()))]


# -- vLLM's own /v1/responses -------------------------------------------------------------------


def native_request(body: Mapping[str, Any], history: Sequence[Any]) -> dict[str, Any]:
    """The request as vLLM's ``/v1/responses`` takes it: raw message tokens and output log
    probabilities asked, the ``history`` a ``previous_response_id`` stands for put before its input."""
    sent = prepare_responses_request({key: value for key, value in body.items() if key != "previous_response_id"})
    given = sent.get("input", "")
    sent["input"] = [*history, *given] if isinstance(given, list) else [*history, _user_message(given)]
    return sent


def native_answer(
    answer: dict[str, Any], bundle: TokenBundle, request: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], Mapping[str, Any]]:
    """vLLM's answer with the bundle on its last output item (an empty message when it has none), the
    chat completion it is recorded as, and that item (whose bundle fields the record takes)."""
    answer.pop("choices", None)
    output = answer["output"]
    if not output:
        empty = {"id": f"msg_{answer.get('id', '')}", "type": "message", "role": "assistant", "status": "completed"}
        output.append({**empty, "content": []})
    last = output[-1]
    last.update(
        zip(
            TOKEN_FIELDS,
            (bundle.prompt_token_ids, bundle.generation_token_ids, bundle.generation_log_probs),
            strict=True,
        )
    )
    answer["previous_response_id"] = request.get("previous_response_id")
    messages = [item for item in output if isinstance(item, dict) and item.get("type") == "message"]
    parts = [part for item in messages for part in item.get("content") or () if isinstance(part, dict)]
    text = "".join(str(part.get("text", "")) for part in parts if part.get("type") == "output_text")
    message = {"role": "assistant", "content": text}
    return answer, {"id": answer.get("id"), "model": answer.get("model"), "choices": [{"message": message}]}, last


# -- streams ----------------------------------------------------------------------------------


@dataclass
class _Item:
    index: int
    item: dict[str, Any]
    delta: SSETemplate
    """The item's delta event, its sequence number and its delta left open."""
    pieces: list[str] = field(default_factory=list)


def error_event(error: ProxyError, sequence: int) -> bytes:
    """A Responses stream's ``error`` event (``sequence``: its ``sequence_number``)."""
    return sse(
        {
            "type": "error",
            "code": error.code or error.openai_type,
            "message": str(error),
            "param": error.param,
            "sequence_number": sequence,
        },
        "error",
    )


@dataclass
class ResponsesEvents:
    """The Responses stream for a captured chat completion stream: ``start()``, then ``feed(chunk)``
    per chat chunk, then ``finish()``; each returns the SSE bytes to send (constant work per chunk)."""

    request: Mapping[str, Any]
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    model: Any = None
    _sequence: int = 0
    _items: list[_Item] = field(default_factory=list)
    _text: _Item | None = None
    _reasoning: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)
    _usage: Any = None
    _finish: Any = None
    _bundles: Any = None
    completed: dict[str, Any] | None = None
    """The whole answer, once ``finish`` has run (what ``response.completed`` carries)."""
    _names: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._names = tool_names(self.request)
        if self.model is None:  # known from the request before the upstream's first chunk names it
            self.model = self.request.get("model")

    def _event(self, kind: str, **data: Any) -> bytes:
        event = sse({"type": kind, "sequence_number": self._sequence, **data}, kind)
        self._sequence += 1
        return event

    def _item_event(self, kind: str, state: _Item, **data: Any) -> bytes:
        """An event about one output item (its id and index first)."""
        return self._event(kind, item_id=state.item["id"], output_index=state.index, **data)

    def error(self, error: ProxyError) -> bytes:
        """The stream's ``error`` event, numbered after the events sent so far."""
        return error_event(error, self._sequence)

    def _snapshot(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return _response(
            self.request, self.response_id, self.created, self.model, status, output, self._usage, self._finish
        )

    def start(self) -> list[bytes]:
        snapshot = self._snapshot("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open(self, item: dict[str, Any], kind: str, /, **fields: Any) -> tuple[_Item, bytes]:
        """An output item opened, with its delta event (of ``kind``, with ``fields``) as a template."""
        index = len(self._items)
        data = {"type": kind, "sequence_number": HOLE, "item_id": item["id"], "output_index": index, **fields}
        opened = _Item(index, item, SSETemplate(data, kind))
        self._items.append(opened)
        added = {**item, "status": "in_progress"}
        return opened, self._event("response.output_item.added", output_index=opened.index, item=added)

    def _delta(self, state: _Item, text: str) -> bytes:
        """The item's delta event carrying ``text`` (kept for its done events)."""
        state.pieces.append(text)
        event = state.delta(self._sequence, text)
        self._sequence += 1
        return event

    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]:
        if chunk.get("model"):
            self.model = chunk["model"]
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        if chunk.get("token_bundles"):
            self._bundles = chunk["token_bundles"][0]
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # a Responses answer has one generation
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                out += self._reasoning_delta(reasoning)
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return out

    def _open_text(self) -> list[bytes]:
        self._text, added = self._open(
            {"id": f"msg_{self.response_id[5:]}", "type": "message", "role": "assistant", "content": []},
            "response.output_text.delta",
            content_index=0,
            delta=HOLE,
            logprobs=[],
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            added,
            self._item_event("response.content_part.added", self._text, content_index=0, part=part),
        ]

    def _reasoning_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._reasoning is None:
            item = {**_reasoning_item(f"rs_{self.response_id[5:]}", ""), "content": []}
            self._reasoning, added = self._open(item, "response.reasoning_text.delta", content_index=0, delta=HOLE)
            part = {"type": "reasoning_text", "text": ""}
            out += [added, self._item_event("response.content_part.added", self._reasoning, content_index=0, part=part)]
        out.append(self._delta(self._reasoning, text))
        return out

    def _text_delta(self, text: str) -> list[bytes]:
        out = self._open_text() if self._text is None else []
        assert self._text is not None
        out.append(self._delta(self._text, text))
        return out

    def _call_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        position = call.get("index", 0)
        state = self._calls.get(position)
        function = call.get("function") or {}
        if state is None:
            item = _call_item(
                f"fc_{self.response_id[5:]}_{position}",
                call.get("id") or "",
                function.get("name") or "",
                "",
                names=self._names,
            )
            state, added = self._open(item, "response.function_call_arguments.delta", delta=HOLE)
            self._calls[position] = state
            out.append(added)
        arguments = function.get("arguments")
        if arguments:
            out.append(self._delta(state, arguments))
        return out

    def finish(self) -> list[bytes]:
        """The closing events of every item and ``response.completed`` (the bundle on the last item)."""
        out = self._open_text() if self._text is None and not self._calls else []  # still one message
        output: list[dict[str, Any]] = []
        for state in self._items:
            joined = "".join(state.pieces)
            if state is self._reasoning:
                final = _reasoning_item(state.item["id"], joined)
                out += [
                    self._item_event("response.reasoning_text.done", state, content_index=0, text=joined),
                    self._item_event("response.content_part.done", state, content_index=0, part=final["content"][0]),
                ]
            elif state is self._text:
                final = _message_item(state.item["id"], joined)
                part = final["content"][0]
                out += [
                    self._item_event("response.output_text.done", state, content_index=0, text=joined, logprobs=[]),
                    self._item_event("response.content_part.done", state, content_index=0, part=part),
                ]
            else:
                item = state.item
                final = {**item, "arguments": joined, "status": "completed"}
                out.append(
                    self._item_event(
                        "response.function_call_arguments.done", state, name=final["name"], arguments=joined
                    )
                )
            output.append(final)
        if self._bundles is not None:
            output[-1].update({name: self._bundles[name] for name in TOKEN_FIELDS if name in self._bundles})
        for state, final in zip(self._items, output, strict=True):
            out.append(self._event("response.output_item.done", output_index=state.index, item=final))
        self.completed = self._snapshot("completed", output)
        out.append(self._event("response.completed", response=self.completed))
        return out
