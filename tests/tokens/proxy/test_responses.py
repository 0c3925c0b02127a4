"""The Responses API to and from chat completions: pure conversions, and the stream chunk by chunk."""

from __future__ import annotations

import json
from typing import Any
from unittest.mock import ANY

import pytest

from tokens.proxy import RequestRejectedError, ResponsesEvents, chat_to_responses, responses_to_chat
from tokens.proxy._responses import dropped_tools, history_of

TOOL = {"type": "function", "name": "get_time", "description": "the time", "parameters": {"type": "object"}}
BUNDLE = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def test_a_string_input_with_instructions_and_sampling() -> None:
    chat = responses_to_chat(
        {
            "model": "m",
            "input": "hi",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0,
            "seed": 3,
            "top_logprobs": 2,
            "store": False,
        }
    )
    assert chat == {
        "model": "m",
        "max_tokens": 7,
        "temperature": 0,
        "seed": 3,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    }


def test_items_of_a_tool_calling_turn() -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "time?"}, {"type": "input_image", "image_url": "data:x"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}], **BUNDLE},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"tz":"Lima"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "10:00"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "05:00"}]},
    ]
    chat = responses_to_chat({"model": "m", "input": items, "tools": [TOOL], "tool_choice": "auto", "stream": True})
    assert chat["messages"] == [
        {"role": "system", "content": "rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "time?"}, {"type": "image_url", "image_url": {"url": "data:x"}}],
        },
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"Lima"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "10:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "05:00"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object"}, "description": "the time"},
        }
    ]
    assert chat["tool_choice"] == "auto" and chat["stream"] is True


def test_a_function_call_without_text_is_its_own_assistant_message() -> None:
    items = [{"role": "user", "content": "t"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]
    assert responses_to_chat({"input": items})["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}],
    }


def test_formats_and_tool_choices() -> None:
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    chat = responses_to_chat(
        {"input": "x", "text": {"format": schema}, "tool_choice": {"type": "function", "name": "f"}}
    )
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert "response_format" not in responses_to_chat({"input": "x", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"input": 3}, "input: must be"),
        ({"input": ["x"]}, "must be an object"),
        ({"input": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id: must be a string"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file'"),
        (
            {
                "input": "x",
                "tools": [
                    {"type": "function", "name": "a__b"},
                    {"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "b"}]},
                ],
            },
            "two tools are called 'a__b'",
        ),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)
def test_what_cannot_be_served_is_refused(body: dict[str, Any], words: str) -> None:
    with pytest.raises(RequestRejectedError, match=words):
        responses_to_chat(body)


def test_namespace_groups_are_flattened_and_hosted_tools_left_out() -> None:
    """Codex CLI's default tools: a namespace group's functions become ``namespace__name`` chat
    functions, a hosted tool is left out (and named by ``dropped_tools``), and a call of a flattened
    function comes back with its namespace and name, in a whole answer and in a stream."""
    inner = {"type": "function", "name": "spawn", "description": "Spawn.", "parameters": {"type": "object"}}
    body = {
        "model": "tiny",
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [inner]},
            {"type": "web_search", "external_web_access": True},
        ],
        "tool_choice": "auto",
    }
    chat = responses_to_chat(body)
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["shell", "agents__spawn"]
    assert chat["tools"][1]["function"]["description"] == "Spawn."
    assert chat["messages"][0]["tool_calls"][0]["function"]["name"] == "agents__spawn"
    assert dropped_tools(body) == [{"where": "tools[2]", "type": "web_search", "reason": ANY}]
    call = {"id": "c2", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    completion = {"model": "tiny", "choices": [{"message": message, "finish_reason": "tool_calls"}]}
    [item] = chat_to_responses(completion, body, "resp_1")["output"]
    assert (item["namespace"], item["name"]) == ("agents", "spawn")
    events = ResponsesEvents(body, "resp_2")
    events.start()
    events.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]}}]})
    events.finish()
    assert events.completed is not None
    [item] = events.completed["output"]
    assert (item["namespace"], item["name"], item["arguments"]) == ("agents", "spawn", "{}")


def test_reasoning_items_travel_as_reasoning_content() -> None:
    """An earlier ``reasoning`` item is the next assistant message's ``reasoning_content`` (what chat
    templates of reasoning models read), whether a text or a call follows it."""
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]}
    chat = responses_to_chat(
        {
            "input": [
                {"role": "user", "content": "hi"},
                reasoning,
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
                {**reasoning, "content": [], "summary": [{"type": "summary_text", "text": "s"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            ]
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "t",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert chat["messages"][3] == {"role": "assistant", "content": "done", "reasoning_content": "s"}


def test_only_hosted_tools_send_no_tools_nor_a_choice() -> None:
    chat = responses_to_chat({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"})
    assert "tools" not in chat and "tool_choice" not in chat


def test_a_refused_item_of_a_chained_request_is_named_by_its_own_index() -> None:
    """The index counted the previous response's items first: input[0] was called input[2]."""
    history = [
        {"type": "message", "role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": "b"},
    ]
    with pytest.raises(RequestRejectedError, match=r"^input\[0\]: items of type 'item_reference'"):
        responses_to_chat({"input": [{"type": "item_reference", "id": "x"}]}, history)


def completion(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }


def test_an_answer_with_text_and_calls_carries_the_bundle_on_its_last_item() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    request = {"model": "m", "input": "t", "tools": [TOOL]}
    answer = chat_to_responses(
        completion({"role": "assistant", "content": "ok", "tool_calls": [call], **BUNDLE}), request, "resp_abc"
    )
    assert [item["type"] for item in answer["output"]] == ["message", "function_call"]
    assert answer["output"][1] == {
        "id": "fc_abc_0",
        "type": "function_call",
        "call_id": "c1",
        "name": "get_time",
        "arguments": "{}",
        "status": "completed",
        **BUNDLE,
    }
    assert "prompt_token_ids" not in answer["output"][0]
    assert answer["status"] == "completed" and answer["incomplete_details"] is None
    assert answer["usage"]["input_tokens"] == 2 and answer["usage"]["total_tokens"] == 3
    assert answer["tools"] == [TOOL] and answer["created_at"] == 5


def test_a_cut_answer_is_incomplete_and_becomes_history() -> None:
    request = {"model": "m", "input": "t"}
    answer = chat_to_responses(completion({"role": "assistant", "content": "o", **BUNDLE}, "length"), request, "resp_x")
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    history = history_of(request, answer)
    assert history[0] == {"type": "message", "role": "user", "content": "t"}
    assert "prompt_token_ids" not in history[1] and history[1]["content"][0]["text"] == "o"
    chat = responses_to_chat({"model": "m", "input": "again"}, history)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user"]


def events_of(data: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for event in data:
        head, body = event.decode().split("\n", 1)
        parsed = json.loads(body.removeprefix("data: "))
        assert head == f"event: {parsed['type']}" and event.endswith(b"\n\n")
        out.append(parsed)
    return out


def test_a_stream_of_text_then_a_call() -> None:
    stream = ResponsesEvents({"model": "m", "input": "t"}, "resp_s", created=1)
    out = stream.start()
    out += stream.feed({"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    out += stream.feed({"choices": [{"index": 0, "delta": {"content": "he"}}]})
    out += stream.feed({"choices": [{"index": 0, "delta": {"content": "y"}}]})
    out += stream.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
                        ]
                    },
                }
            ]
        }
    )
    out += stream.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    out += stream.feed(
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}, "token_bundles": [BUNDLE]}
    )
    out += stream.finish()
    events = events_of(out)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "hey"
    assert done["output"][1]["arguments"] == '{"a": 1}' and done["output"][1]["generation_token_ids"] == [3]
    assert done["usage"]["output_tokens"] == 1 and stream.completed == done


def test_an_empty_stream_is_one_empty_message() -> None:
    stream = ResponsesEvents({"input": "t"}, "resp_e")
    events = events_of([*stream.start(), *stream.feed({"choices": [{"index": 0, "delta": {}}]}), *stream.finish()])
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
