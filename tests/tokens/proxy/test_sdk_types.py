"""Every answer, event and error the proxy sends validates, strictly (``model_validate(strict=True)``),
against the official SDKs' own pydantic types: ``openai`` for chat completions and Responses,
``anthropic`` for Messages; each event by the type its ``type`` names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from anthropic.types import ErrorResponse, Message
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from openai.types.shared import ErrorObject

from pytest_llm_sandbox_middleware import CaptureProxy, running_capture_proxy
from tests.tokens.proxy.sdk_types import MESSAGES_EVENTS, RESPONSES_EVENTS, sse_events, strict
from tokens.proxy import ContextWindowError, ProxyError, UpstreamTimeoutError
from tokens.proxy._messages import MessagesEvents
from tokens.proxy._responses import ResponsesEvents

FUNCTION = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
NAMESPACE = {"type": "namespace", "name": "clock", "description": "Clocks.", "tools": [FUNCTION]}
HOSTED = {"type": "web_search", "external_web_access": True}
CLIENT_TOOL = {"name": "get_time", "input_schema": {"type": "object"}}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search"}
USER = [{"role": "user", "content": "What time is it?"}]


def events(answer: httpx.Response) -> Iterator[tuple[str | None, dict[str, Any]]]:
    assert answer.headers["content-type"].startswith("text/event-stream"), answer.text[:500]
    return sse_events(answer.content)


@pytest.fixture(scope="module")
def proxy() -> Iterator[CaptureProxy]:
    with running_capture_proxy() as proxy:
        yield proxy


def post(proxy: CaptureProxy, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proxy.base_url("rollout-types") + path, json=body, timeout=30)


@pytest.mark.parametrize("tools", [None, [FUNCTION], [NAMESPACE, HOSTED]], ids=["text", "function", "namespace"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_answers_and_events(proxy: CaptureProxy, tools: Any, stream: bool) -> None:
    if tools:
        proxy.fake.reply_tool_call("clock__get_time" if tools[0] is NAMESPACE else "get_time", {"tz": "Oslo"})
    body: dict[str, Any] = {"model": "tiny", "input": "What time is it?", "max_output_tokens": 300, "stream": stream}
    if tools:
        body["tools"] = tools
    answer = post(proxy, "/responses", body)
    assert answer.status_code == 200, answer.text
    if stream:
        seen = [strict(RESPONSES_EVENTS[data["type"]], data) for _, data in events(answer)]
        assert seen[0].type == "response.created" and seen[0].response.model == "tiny"  # type: ignore[attr-defined]
        final = seen[-1].response  # type: ignore[attr-defined]
    else:
        final = strict(Response, answer.json())
    assert final.status == "completed"
    if tools:
        call = final.output[-1]
        assert call.type == "function_call" and call.name == "get_time"
        assert call.namespace == ("clock" if tools[0] is NAMESPACE else None)


@pytest.mark.parametrize("tools", [None, [CLIENT_TOOL, SERVER_TOOL]], ids=["text", "tools"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_answers_and_events(proxy: CaptureProxy, tools: Any, stream: bool) -> None:
    if tools:
        proxy.fake.reply_tool_call("get_time", {"tz": "Oslo"})
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 300, "messages": USER, "stream": stream}
    if tools:
        body["tools"] = tools
    answer = httpx.post(proxy.url + "/r/rollout-types/v1/messages", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    if stream:
        for name, data in events(answer):
            assert name == data["type"]
            strict(MESSAGES_EVENTS[data["type"]], data)
    else:
        message = strict(Message, answer.json())
        assert message.model == "tiny"  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_answers_and_chunks(proxy: CaptureProxy, stream: bool) -> None:
    answer = post(proxy, "/chat/completions", {"model": "tiny", "messages": USER, "stream": stream})
    assert answer.status_code == 200, answer.text
    if stream:
        for _, data in events(answer):
            strict(ChatCompletionChunk, data)
    else:
        strict(ChatCompletion, answer.json())


def test_errors_in_each_dialect(proxy: CaptureProxy) -> None:
    refused = post(proxy, "/responses", {"model": "tiny", "input": 3})
    assert refused.status_code == 400
    strict(ErrorObject, refused.json()["error"])
    refused = httpx.post(proxy.url + "/v1/messages", json={"model": "tiny", "messages": USER}, timeout=30)
    assert refused.status_code == 400
    strict(ErrorResponse, refused.json())
    proxy.fake.reply_error(500, "boom")
    failed = post(proxy, "/responses", {"model": "tiny", "input": "hi", "stream": True})
    assert failed.status_code == 502  # before the stream started: a JSON error
    strict(ErrorObject, failed.json()["error"])


@pytest.mark.parametrize("error", [UpstreamTimeoutError("slow"), ContextWindowError("prompt is too long: 9 > 8")])
def test_error_events_inside_a_stream(error: ProxyError) -> None:
    [(_, data)] = events_of(ResponsesEvents({"model": "tiny"}, "resp_1").error(error))
    strict(RESPONSES_EVENTS["error"], data)
    [(name, data)] = events_of(MessagesEvents().error(error))
    assert name == "error"
    strict(ErrorResponse, data)


def events_of(data: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    return list(events(httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data)))


THOUGHT = "<think>The clock says noon.</think>\n\nIt is noon."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_comes_out_as_each_dialect_s_own(proxy: CaptureProxy, stream: bool) -> None:
    """vLLM's reasoning (``--reasoning-parser``) becomes a Responses ``reasoning`` item and an Anthropic
    ``thinking`` block, before the answer's text, whole and streamed."""
    proxy.fake.reasoning_parser = True
    try:
        proxy.fake.reply(THOUGHT)
        body = {"model": "tiny", "input": "What time is it?", "max_output_tokens": 300, "stream": stream}
        answer = post(proxy, "/responses", body)
        if stream:
            final = [strict(RESPONSES_EVENTS[data["type"]], data) for _, data in events(answer)][-1].response  # type: ignore[attr-defined]
        else:
            final = strict(Response, answer.json())
        reasoning, message = final.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "The clock says noon."
        assert message.type == "message" and message.content[0].text == "It is noon."
        proxy.fake.reply(THOUGHT)
        body = {"model": "tiny", "max_tokens": 300, "messages": USER, "stream": stream}
        answer = httpx.post(proxy.url + "/v1/messages", json=body, timeout=30)
        if stream:
            seen = [strict(MESSAGES_EVENTS[data["type"]], data) for _, data in events(answer)]
            thinking = "".join(
                e.delta.thinking for e in seen if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
            )  # type: ignore[attr-defined]
            text = "".join(
                e.delta.text for e in seen if e.type == "content_block_delta" and e.delta.type == "text_delta"
            )  # type: ignore[attr-defined]
        else:
            message = strict(Message, answer.json())
            thinking, text = message.content[0].thinking, message.content[1].text  # type: ignore[attr-defined]
        assert (thinking, text) == ("The clock says noon.", "It is noon.")
    finally:
        proxy.fake.reasoning_parser = False
