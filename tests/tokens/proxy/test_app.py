"""The proxy in front of FakeVLLM with the official ``openai`` and ``anthropic`` SDKs as its clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pytest_llm_sandbox_middleware import CaptureProxy, FakeVLLMTransport
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.token_samples import sample
from tokens.proxy import ProxyServer, create_app
from tokens.testing import FAKE_VLLM_URL, FakeTokenizer, FakeVLLM

TOKENIZER = FakeTokenizer()
USER = [{"role": "user", "content": "What time is it?"}]
TOOL_CHAT = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def openai_client(proxy: CaptureProxy, rollout: str | None = "rollout-1") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url(rollout), api_key="agent-key", max_retries=0)


def anthropic_client(proxy: CaptureProxy, rollout: str = "rollout-1") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.base_url(rollout).removesuffix("/v1"), api_key="k", max_retries=0)


def fields(model: Any) -> dict[str, Any]:
    return dict(model.model_extra or {})


def check_bundle(extra: dict[str, Any], messages: list[dict[str, Any]], text: str, tools: Any = None) -> None:
    """The bundle is FakeVLLM's own: its template's prompt ids, the text's ids and the end-of-turn token."""
    assert extra["prompt_token_ids"] == TOKENIZER.apply_chat_template(messages, tools)
    assert extra["generation_token_ids"] == [*TOKENIZER.encode(text), FakeTokenizer.IM_END]
    assert len(extra["generation_log_probs"]) == len(extra["generation_token_ids"])


def test_chat_completions_whole_and_streamed(capture_proxy: CaptureProxy) -> None:
    client = openai_client(capture_proxy)
    completion = client.chat.completions.create(model="tiny", messages=USER, max_tokens=64)  # type: ignore[arg-type]
    message = completion.choices[0].message
    check_bundle(fields(message), USER, message.content or "")
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=64, stream=True))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    check_bundle(fields(chunks[-1])["token_bundles"][0], USER, text)
    sent = capture_proxy.fake.requests[-1][1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True


def test_responses_whole_streamed_and_chained(capture_proxy: CaptureProxy) -> None:
    client = openai_client(capture_proxy)
    first = client.responses.create(model="tiny", input="What time is it?", max_output_tokens=64)
    assert capture_proxy.fake.requests[-2][0] == "/v1/responses"  # asked first; FakeVLLM has no such route
    assert capture_proxy.fake.requests[-1][0] == "/v1/chat/completions"
    check_bundle(fields(first.output[-1]), USER, first.output_text)
    assert first.status == "completed" and first.usage is not None and first.usage.output_tokens > 0
    with client.responses.stream(model="tiny", input="What time is it?", max_output_tokens=64) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == first.output_text
    check_bundle(fields(streamed.output[-1]), USER, first.output_text)
    second = client.responses.create(model="tiny", input="And in Lima?", previous_response_id=first.id)
    turn1 = fields(first.output[-1])
    prompt = fields(second.output[-1])["prompt_token_ids"]
    whole = [*turn1["prompt_token_ids"], *turn1["generation_token_ids"]]
    assert prompt[: len(whole)] == whole  # the chain is the conversation: turn 1 is a prefix of turn 2
    third = client.responses.create(model="tiny", input="Thanks", previous_response_id=streamed.id, stream=True)
    done = next(event for event in third if event.type == "response.completed")
    assert fields(done.response.output[-1])["prompt_token_ids"][: len(whole)] == whole


def test_messages_whole_and_streamed(capture_proxy: CaptureProxy) -> None:
    client = anthropic_client(capture_proxy)
    message = client.messages.create(model="tiny", max_tokens=64, messages=USER)  # type: ignore[arg-type]
    assert message.content[0].type == "text" and message.stop_reason == "end_turn"
    check_bundle(fields(message), USER, message.content[0].text)
    with client.messages.stream(model="tiny", max_tokens=64, messages=USER) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == message.content[0].text
    delta = next(event for event in events if event.type == "message_delta")
    check_bundle(fields(delta), USER, message.content[0].text)
    assert final.usage.input_tokens == len(fields(message)["prompt_token_ids"])


def test_a_tool_call_through_each_dialect(capture_proxy: CaptureProxy) -> None:
    fake = capture_proxy.fake
    fake.reply_tool_call("get_time", {"tz": "Oslo"})
    chat = openai_client(capture_proxy).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[TOOL_CHAT],  # type: ignore[arg-type,list-item]
        max_tokens=200,
    )
    call = chat.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "Oslo"}  # type: ignore[union-attr]
    fake.reply_tool_call("get_time", {"tz": "Oslo"})
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    response = openai_client(capture_proxy).responses.create(
        model="tiny",
        input="t",
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=200,
    )
    assert [item.type for item in response.output] == ["function_call"]
    assert fake.requests[-1][0] == "/v1/chat/completions" and fake.requests[-2][0] != "/v1/responses"
    assert fields(response.output[0])["generation_token_ids"][-1] == FakeTokenizer.IM_END
    fake.reply_tool_call("get_time", {"tz": "Oslo"})
    message = anthropic_client(capture_proxy).messages.create(
        model="tiny",
        max_tokens=200,
        messages=USER,  # type: ignore[arg-type]
        tools=[{"name": "get_time", "input_schema": {"type": "object"}}],
    )
    assert message.stop_reason == "tool_use" and message.content[0].type == "tool_use"
    assert message.content[0].input == {"tz": "Oslo"}


def test_coordinates_from_the_path_and_headers(capture_proxy: CaptureProxy) -> None:
    with httpx.Client(base_url=capture_proxy.url) as http:
        answer = http.post("/r/rollout-7/v1/chat/completions", json={"model": "tiny", "messages": USER})
        assert answer.headers["x-rollout-id"] == "rollout-7" and answer.headers["x-model-call-id"].startswith("call_")
        answer = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": USER},
            headers={"X-Rollout-Id": "r8", "X-Model-Call-Id": "turn-1"},
        )
        assert (answer.headers["x-rollout-id"], answer.headers["x-model-call-id"]) == ("r8", "turn-1")
        bad = http.post("/r/bad%20id/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": USER})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "rollout id" in bad.json()["error"]["message"]
        missing = http.post("/v1/embeddings", json={})
        assert missing.status_code == 404 and "not served" in missing.json()["error"]["message"]
        models = http.get("/r/x/v1/models")
        assert models.json()["data"][0]["id"] == "tiny"
    assert all("x-rollout-id" not in str(body) for _, body in capture_proxy.fake.requests)


def test_an_upstream_5xx_is_an_upstream_error_502_and_its_503_passes_on(capture_proxy: CaptureProxy) -> None:
    """A 500 from the upstream was a plain ProxyError (OpenAI type server_error): it is the
    UpstreamError docs/proxy.md names (502, upstream_error); a 503 keeps its status."""
    capture_proxy.fake.fail_next(500)
    with pytest.raises(openai.InternalServerError) as failed:
        openai_client(capture_proxy).chat.completions.create(model="tiny", messages=USER)  # type: ignore[arg-type]
    assert failed.value.status_code == 502 and failed.value.type == "upstream_error"
    assert "the upstream answered HTTP 500" in failed.value.message
    capture_proxy.fake.fail_next(503)
    with pytest.raises(openai.InternalServerError) as overloaded:
        openai_client(capture_proxy).chat.completions.create(model="tiny", messages=USER)  # type: ignore[arg-type]
    assert overloaded.value.status_code == 503


def test_upstream_errors_in_each_dialect(capture_proxy: CaptureProxy) -> None:
    with pytest.raises(openai.BadRequestError) as chat_error:
        openai_client(capture_proxy).chat.completions.create(model="tiny", messages=USER, max_tokens=5000)  # type: ignore[arg-type]
    assert "max_model_len" in chat_error.value.message and "fake-vllm.test" not in chat_error.value.message
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        anthropic_client(capture_proxy).messages.create(model="tiny", max_tokens=5000, messages=USER)  # type: ignore[arg-type]
    assert messages_error.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    capture_proxy.fake.fail_next(429, times=2)
    with pytest.raises(openai.RateLimitError):
        openai_client(capture_proxy).responses.create(model="tiny", input="x", tools=[])
    with pytest.raises(anthropic.RateLimitError):
        anthropic_client(capture_proxy).messages.create(model="tiny", max_tokens=5, messages=USER)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        openai_client(capture_proxy).responses.create(model="tiny", input="x", previous_response_id="resp_gone")
    with pytest.raises(openai.BadRequestError, match="two tools are called"):
        openai_client(capture_proxy).responses.create(
            model="tiny",
            input="x",
            tools=[  # type: ignore[list-item]
                {"type": "function", "name": "a__b"},
                {"type": "namespace", "name": "a", "description": "", "tools": [{"type": "function", "name": "b"}]},
            ],
        )


class ResponsesVLLM(FakeVLLMTransport):
    """FakeVLLM plus vLLM's ``/v1/responses`` answering with the recorded raw message tokens."""

    def __init__(self, fake: FakeVLLM) -> None:
        super().__init__(fake)
        self.sent: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/responses":
            self.sent.append(json.loads(await request.aread()))
            return httpx.Response(200, json=sample("responses_raw_message_tokens.response"))
        return await super().handle_async_request(request)


@pytest.fixture
def responses_proxy() -> Iterator[tuple[ProxyServer, ResponsesVLLM]]:
    transport = ResponsesVLLM(FakeVLLM())
    with ProxyServer(create_app(FAKE_VLLM_URL + "/v1", transport=transport)) as server:
        yield server, transport


def test_responses_through_vllms_own_endpoint(responses_proxy: tuple[ProxyServer, ResponsesVLLM]) -> None:
    server, transport = responses_proxy
    recorded = sample("responses_raw_message_tokens.response")
    client = openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0)
    answer = client.responses.create(
        model="tiny", input=[{"role": "user", "content": "What time is it?"}], max_output_tokens=8, temperature=0
    )
    extra = fields(answer.output[-1])
    assert extra["prompt_token_ids"] == recorded["input_messages"][0]["tokens"]
    assert extra["generation_token_ids"] == recorded["output_messages"][0]["tokens"]
    assert answer.output_text == recorded["output"][0]["content"][0]["text"]
    assert "input_messages" not in (answer.model_extra or {})
    sent = transport.sent[-1]
    assert sent["enable_response_messages"] is True and sent["include"] == ["message.output_text.logprobs"]
    follow = client.responses.create(model="tiny", input="more", previous_response_id=answer.id)
    assert transport.sent[-1]["input"][1]["type"] == "message" and "previous_response_id" not in transport.sent[-1]
    assert "prompt_token_ids" not in transport.sent[-1]["input"][1] and follow.status == "incomplete"


def test_a_span_and_a_duration_per_call_by_dialect(telemetry: TelemetryCapture) -> None:
    fake = FakeVLLM()
    app = create_app(
        FAKE_VLLM_URL + "/v1",
        transport=FakeVLLMTransport(fake),
        meter_provider=telemetry.meter_provider,
        tracer_provider=telemetry.tracer_provider,
    )
    with ProxyServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0)
        client.chat.completions.create(model="tiny", messages=USER)  # type: ignore[arg-type]
        list(client.responses.create(model="tiny", input="x", stream=True))
        messages = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        messages.messages.create(model="tiny", max_tokens=8, messages=USER)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError):
            messages.messages.create(model="tiny", max_tokens=5000, messages=USER)  # type: ignore[arg-type]
    names = sorted(span.name for span in telemetry.spans() if span.name.startswith("tokens.proxy"))
    assert names == ["tokens.proxy chat", "tokens.proxy messages", "tokens.proxy messages", "tokens.proxy responses"]
    stream_span = telemetry.spans("tokens.proxy responses")[0]
    assert stream_span.attributes is not None and stream_span.attributes["tokens.proxy.stream"] is True
    for span in telemetry.spans():
        assert "fake-vllm.test" not in json.dumps(dict(span.attributes or {}))
    for dialect in ("chat", "responses"):
        assert (
            telemetry.histogram_count(
                "tokens.proxy.duration_ms", tokens__proxy__dialect=dialect, tokens__proxy__outcome="ok"
            )
            == 1
        )
    assert telemetry.histogram_count("tokens.proxy.duration_ms", tokens__proxy__dialect="messages") == 2
    assert telemetry.histogram_count("tokens.proxy.duration_ms", tokens__proxy__outcome="ProxyError") == 1


def test_a_call_is_one_span_from_its_request_to_its_last_byte(telemetry: TelemetryCapture) -> None:
    """The capture's own span is a child of the call's (a stream's too), and a request refused before
    anything went upstream has its span and its duration, with the error's type."""
    app = create_app(
        FAKE_VLLM_URL + "/v1",
        transport=FakeVLLMTransport(FakeVLLM()),
        meter_provider=telemetry.meter_provider,
        tracer_provider=telemetry.tracer_provider,
    )
    with ProxyServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0)
        assert list(client.chat.completions.create(model="tiny", messages=USER, stream=True))  # type: ignore[arg-type]
        refused = httpx.post(server.url + "/v1/messages", content=b"{not json")
    assert refused.status_code == 400
    streamed, failed = telemetry.spans("tokens.proxy chat")[0], telemetry.spans("tokens.proxy messages")[0]
    captured = [span for span in telemetry.spans() if span.name.startswith("tokens.chat_completion")]
    assert captured and all(span.parent is not None for span in captured)
    assert {span.parent.span_id for span in captured if span.parent} == {streamed.context.span_id}
    assert streamed.attributes is not None and streamed.attributes["tokens.proxy.upstream_api"] == "chat"
    assert failed.attributes is not None and failed.attributes["error.type"] == "tokens.proxy.RequestRejectedError"
    assert "tokens.proxy.upstream_api" not in failed.attributes
    assert (
        telemetry.histogram_count(
            "tokens.proxy.duration_ms", tokens__proxy__dialect="messages", tokens__proxy__outcome="RequestRejectedError"
        )
        == 1
    )
