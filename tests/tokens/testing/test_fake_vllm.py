"""tokens.testing.FakeVLLM: vLLM 0.32's field sets (checked against recorded answers), consistent endpoints,
usable through respx, httpx.MockTransport, TokenClient and the OpenAI SDK; the pytest plugin's fixtures."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import stamina

from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.token_samples import FIXTURES, RECORDED_EXCHANGES, keys, recorded_request, sample
from tokens import ContextLengthExceededError, ServerResponseError, TokenCaptureTransport, TokenClient
from tokens.testing import FAKE_VLLM_URL, FakeTokenizer, FakeVLLM

pytestmark = pytest.mark.anyio

V1 = FAKE_VLLM_URL + "/v1"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Oslo?"}]


def ask(fake: FakeVLLM, path: str, body: Any) -> httpx.Response:
    return fake(httpx.Request("POST", FAKE_VLLM_URL + path, json=body))


@pytest.mark.parametrize(("name", "path"), RECORDED_EXCHANGES)
@pytest.mark.anyio(False)
def test_field_sets_equal_the_recorded_answers(name: str, path: str) -> None:
    """For each recorded request, the fake's answer has exactly the real answer's fields, at every level."""
    real, request = sample(f"{name}.response"), recorded_request(name, FakeTokenizer.VOCAB_SIZE)
    fake = FakeVLLM(max_model_len=2048)(httpx.Request("POST", FAKE_VLLM_URL + path, json=request))
    assert fake.status_code == (400 if name.startswith("error") else 200)
    assert keys(fake.json()) == keys(real)


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("chat_stream_inline_ids", "/chat/completions"),
        ("completions_stream_inline_ids", "/completions"),
        ("completions_stream_n2", "/completions"),
    ],
)
@pytest.mark.anyio(False)
def test_stream_field_sets_equal_the_recorded_stream(name: str, path: str) -> None:
    real = [
        json.loads(e[6:])
        for e in (FIXTURES / f"{name}.response.sse").read_bytes().split(b"\n\n")
        if e.startswith(b"data: {")
    ]
    answer = FakeVLLM()(httpx.Request("POST", V1 + path, json=sample(f"{name}.request")))
    events = answer.content.split(b"\n\n")
    fake = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert b"data: [DONE]" in events
    assert [keys(chunk) for chunk in fake] == [keys(chunk) for chunk in real]


@pytest.mark.anyio(False)
def test_endpoints_agree_with_each_other() -> None:
    """/tokenize gives the chat prompt ids; /detokenize of the generation gives the content; token-in echoes."""
    fake = FakeVLLM(replies=["ok, 12:00"])
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 64,
        "logprobs": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    answer = ask(fake, "/v1/chat/completions", body).json()
    tokenized = ask(fake, "/tokenize", {"model": "tiny", "messages": MESSAGES}).json()["tokens"]
    assert answer["prompt_token_ids"] == tokenized
    generated = answer["choices"][0]["token_ids"]
    assert generated[-1] == FakeTokenizer.IM_END and answer["choices"][0]["finish_reason"] == "stop"
    assert ask(fake, "/detokenize", {"tokens": generated[:-1]}).json()["prompt"] == "ok, 12:00"
    assert answer["choices"][0]["message"]["content"] == "ok, 12:00"
    assert [e["token"] for e in answer["choices"][0]["logprobs"]["content"]] == [f"token_id:{i}" for i in generated]
    continued = ask(
        fake, "/v1/completions", {"model": "tiny", "prompt": tokenized, "return_token_ids": True, "max_tokens": 4}
    ).json()
    assert continued["choices"][0]["prompt_token_ids"] == tokenized
    assert continued["usage"]["completion_tokens"] == len(continued["choices"][0]["token_ids"]) == 4
    again = ask(FakeVLLM(), "/v1/chat/completions", body).json()
    assert again["choices"][0]["token_ids"] != generated  # unscripted: deterministic text of its own
    assert ask(FakeVLLM(), "/v1/chat/completions", body).json()["choices"] == again["choices"]


async def test_token_client_against_the_fake_with_mock_transport(telemetry: TelemetryCapture) -> None:
    """As an httpx.MockTransport: inline ids, the /tokenize fallback, n=3, a context-length error."""
    fake = FakeVLLM(max_model_len=256)
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    async with http, TokenClient(V1, http_client=http, request_prompt_and_generation_token_ids=True) as client:
        inline = await client.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8)
        group = await client.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8, n=3)
        with pytest.raises(ContextLengthExceededError, match="maximum context length is 256"):
            await client.chat_completion(model="tiny", messages=[{"role": "user", "content": "x" * 300}])
    async with TokenClient(V1, http_client=httpx.AsyncClient(transport=httpx.MockTransport(fake))) as fallback:
        reconstructed = await fallback.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8)
    assert inline.bundle.source == "vllm" and reconstructed.bundle.source == "tokenize"
    assert reconstructed.bundle.prompt_token_ids == inline.bundle.prompt_token_ids
    assert len(group.bundles) == 3 and len({tuple(b.generation_token_ids) for b in group.bundles}) == 3


async def test_fixture_retries_and_the_sdk(fake_vllm: FakeVLLM) -> None:
    """The plugin's fake_vllm (respx): a 429 with Retry-After is retried; the OpenAI SDK gets the ids."""
    fake_vllm.fail_next(429, retry_after=0.01)
    with stamina.set_testing(True, attempts=3):
        async with TokenClient(V1, request_prompt_and_generation_token_ids=True) as client:
            completion = await client.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8)
    assert [path for path, _ in fake_vllm.requests] == ["/v1/chat/completions"] * 2
    fake_vllm.fail_next(503, times=5)
    async with TokenClient(V1, retry=None) as client:
        with pytest.raises(ServerResponseError, match="HTTP 503"):
            await client.chat_completion(model="tiny", messages=MESSAGES)
    fake_vllm._faults.clear()
    fake_vllm.reply("scripted")
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    http = httpx.AsyncClient(transport=transport)
    async with openai.AsyncOpenAI(base_url=V1, api_key="-", http_client=http) as sdk:
        answer = await sdk.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
    message: Any = answer.choices[0].message
    assert message.content == "scripted"
    assert message.prompt_token_ids == completion.bundle.prompt_token_ids
    assert FakeTokenizer().decode(message.generation_token_ids) == "scripted<|im_end|>"


def test_fault_provider_fixture(fault_provider: FaultInjectingProvider) -> None:
    assert isinstance(fault_provider, FaultInjectingProvider) and fault_provider.alive == set()


async def test_scripted_tool_call_through_the_sdk(fake_vllm: FakeVLLM) -> None:
    """A scripted tool call: the SDK sees message.tool_calls; the bundle holds the ids of the generated call text."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    fake_vllm.reply_tool_call("get_time", {"tz": "Europe/Oslo"})
    http = httpx.AsyncClient(transport=TokenCaptureTransport(request_prompt_and_generation_token_ids=True))
    async with openai.AsyncOpenAI(base_url=V1, api_key="-", http_client=http) as sdk:
        answer = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, max_tokens=200)  # type: ignore[arg-type]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "Europe/Oslo"}  # type: ignore[union-attr]
    text = FakeTokenizer().decode((choice.message.model_extra or {})["generation_token_ids"])
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call><|im_end|>")
    assert "tools: " in FakeTokenizer().decode((choice.message.model_extra or {})["prompt_token_ids"])


@pytest.mark.anyio(False)
def test_scripted_tokens_and_errors_are_answered_in_order() -> None:
    """reply_tokens sends the ids and log probabilities as given; reply_error answers the generation
    request whose turn it is (a /tokenize in between does not use it); then the fake's own texts."""
    fake = FakeVLLM()
    fake.reply("first")
    fake.reply_error(503, "busy", retry_after=2)
    fake.reply_tokens([75, 107, FakeTokenizer.IM_END], [-0.5, -0.25, -0.01])
    fake.reply_error(400)
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, "return_token_ids": True}
    first = ask(fake, "/v1/chat/completions", body)
    assert first.json()["choices"][0]["message"]["content"] == "first"
    assert ask(fake, "/tokenize", {"model": "tiny", "messages": MESSAGES}).status_code == 200
    busy = ask(fake, "/v1/chat/completions", body)
    assert (busy.status_code, busy.headers["retry-after"]) == (503, "2")
    assert busy.json()["error"] == {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}
    [choice] = ask(fake, "/v1/chat/completions", body).json()["choices"]
    assert choice["token_ids"] == [75, 107, FakeTokenizer.IM_END] and choice["message"]["content"] == "Hh"
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5, -0.25, -0.01]
    refused = ask(fake, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "Bad Request"
    assert ask(fake, "/v1/completions", {"model": "tiny", "prompt": "x"}).status_code == 200  # the fake's own
    cut = FakeVLLM()
    cut.reply_tokens([75, 76, 77, 78], [-1.0, -2.0, -3.0, -4.0])
    [choice] = ask(cut, "/v1/chat/completions", {**body, "max_tokens": 2}).json()["choices"]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [75, 76]
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-1.0, -2.0]
    with pytest.raises(ValueError, match="from 0 to 258"):
        fake.reply_tokens([259])
    with pytest.raises(ValueError, match="2 log probabilities for 1 token ids"):
        fake.reply_tokens([5], [-1.0, -2.0])
    with pytest.raises(ValueError, match="from 400 to 599, not 302"):
        fake.reply_error(302)
