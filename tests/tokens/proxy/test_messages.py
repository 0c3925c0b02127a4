"""Anthropic Messages to and from chat completions: pure conversions, and the stream chunk by chunk."""

from __future__ import annotations

import json
from typing import Any
from unittest.mock import ANY

import pytest

from tokens.proxy import MessagesEvents, RequestRejectedError, chat_to_messages, messages_to_chat
from tokens.proxy._messages import dropped_tools

BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_a_tool_calling_conversation() -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief."}],
        "temperature": 0,
        "stop_sequences": ["X"],
        "top_k": 5,
        "tools": [{"name": "get_time", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "time?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "..", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"tz": "Ø"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "10:00"},
                    {"type": "text", "text": "and Lima?"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no"}],
                    }
                ],
            },
        ],
    }
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "Ø"}'}}
            ],
            "reasoning_content": "..",  # the thinking block, carried
        },
        {"role": "tool", "tool_call_id": "t1", "content": "10:00"},
        {"role": "user", "content": "and Lima?"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}, "description": "d"}}
    ]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert (chat["max_tokens"], chat["stop"], chat["top_k"], chat["temperature"]) == (9, ["X"], 5, 0)


def test_images_and_a_call_only_turn() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QQ=="}}
    chat = messages_to_chat(
        {
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "see"}, image]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            ],
        }
    )
    assert chat["messages"][0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/jpeg;base64,QQ=="},
    }
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 1, "messages": []}, "non-empty"),
        ({"max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]}, "name"),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "x"}},
            "tool_choice",
        ),
    ],
)
def test_what_cannot_be_served_is_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(RequestRejectedError, match=words):
        messages_to_chat(body)


def test_system_messages_inside_messages_are_folded_and_server_tools_left_out() -> None:
    """Claude Code sends a ``system`` message inside ``messages`` for a model it does not know: it joins
    the leading system message (every chat template takes one there); a server tool is left out and
    named by ``dropped_tools``."""
    body = {
        "max_tokens": 9,
        "system": [{"type": "text", "text": "You are an agent."}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {}}]},
            {"role": "user", "content": "read it"},
        ],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "w"}],
    }
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        {
            "role": "system",
            "content": [{"type": "text", "text": "You are an agent."}, {"type": "text", "text": "# Environment"}],
        },
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "read it"},
    ]
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["Bash"]
    assert dropped_tools(body) == [{"where": "tools[1]", "type": "web_search_20250305", "reason": ANY}]


def test_thinking_blocks_travel_as_reasoning_content() -> None:
    thinking = {"type": "thinking", "thinking": "look first", "signature": ""}
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    chat = messages_to_chat(
        {
            "max_tokens": 9,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [thinking, use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]},
                {"role": "assistant", "content": [thinking, {"type": "redacted_thinking", "data": "x"}]},
            ],
        }
    )
    assert chat["messages"][1]["reasoning_content"] == "look first" and chat["messages"][1]["tool_calls"]
    assert chat["messages"][3] == {"role": "assistant", "content": "", "reasoning_content": "look first"}


def test_an_answer_with_a_tool_call() -> None:
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bad = {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    answer = chat_to_messages(
        {
            "id": "chatcmpl-1",
            "model": "m",
            "usage": {"prompt_tokens": 4, "completion_tokens": 2},
            "choices": [
                {"message": {"content": "ok", "tool_calls": [call, bad], **BUNDLE}, "finish_reason": "tool_calls"}
            ],
        }
    )
    assert answer["content"] == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "t2", "name": "f", "input": {"_unparsed_arguments": "{oops"}},
    ]
    assert answer["stop_reason"] == "tool_use" and answer["usage"] == {"input_tokens": 4, "output_tokens": 2}
    assert answer["generation_token_ids"] == [3] and answer["type"] == "message"


@pytest.mark.parametrize(("finish", "stop"), [("stop", "end_turn"), ("length", "max_tokens"), (None, "end_turn")])
def test_stop_reasons(finish: str | None, stop: str) -> None:
    answer = chat_to_messages({"choices": [{"message": {"content": "x"}, "finish_reason": finish}]})
    assert answer["stop_reason"] == stop


def test_a_stream_of_text_then_a_call() -> None:
    stream = MessagesEvents()
    out = stream.feed(
        {
            "id": "c",
            "model": "m",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
    )
    out += stream.feed({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    out += stream.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "f", "arguments": "{}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    out += stream.feed(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "token_bundles": [BUNDLE]}
    )
    out += stream.finish()
    events = []
    for event in out:
        head, body = event.decode().split("\n", 1)
        parsed = json.loads(body.removeprefix("data: "))
        assert head == f"event: {parsed['type']}"
        events.append(parsed)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 3
    assert events[4]["content_block"] == {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    assert events[5] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": "{}"},
    }
    assert events[7]["delta"]["stop_reason"] == "tool_use" and events[7]["usage"] == {"output_tokens": 2}
    assert events[7]["generation_token_ids"] == [3]
