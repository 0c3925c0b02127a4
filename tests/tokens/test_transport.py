"""TokenCaptureTransport: capture inside the real OpenAI SDK and plain httpx clients, over respx."""

from __future__ import annotations

import base64
import copy
import json
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import respx

from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.token_samples import BASE, CHAT, INLINE, LOGPROBS_ONLY, TOKENIZE, TOKENIZED
from tokens import (
    ConflictingTokenMetadataError,
    ResponseTooLargeError,
    ServerResponseError,
    TokenCaptureTransport,
    TokenClient,
    TokensError,
    UnsupportedRequestError,
)

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def server() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


def sdk(transport: httpx.AsyncBaseTransport, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=BASE, api_key="sk-test", http_client=httpx.AsyncClient(transport=transport), **options
    )


async def test_sdk_completion_carries_the_exact_ids(server: respx.MockRouter) -> None:
    """Through the OpenAI SDK the message carries the bundle, equal to TokenClient's from the same bytes."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    async with sdk(TokenCaptureTransport(request_prompt_and_generation_token_ids=True)) as client:
        completion = await client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
    message: Any = completion.choices[0].message
    assert message.prompt_token_ids == INLINE["prompt_token_ids"]
    assert message.generation_token_ids == INLINE["choices"][0]["token_ids"]
    assert message.generation_log_probs == [e["logprob"] for e in INLINE["choices"][0]["logprobs"]["content"]]
    assert message.content == INLINE["choices"][0]["message"]["content"]
    assert completion.choices[0].logprobs is None  # the transport fields are gone, as with TokenClient
    sent = json.loads(chat.calls.last.request.content)
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and sent["top_logprobs"] == 0
    assert chat.calls.last.request.headers["authorization"] == "Bearer sk-test"
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as direct:
        same = await direct.chat_completion(model="tiny", messages=MESSAGES)
    assert same.response == json.loads(completion.model_dump_json(exclude_unset=True))


async def test_tokenize_fallback_goes_through_the_inner_transport_with_the_credentials(
    server: respx.MockRouter,
) -> None:
    server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    tokenize = server.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
    async with sdk(TokenCaptureTransport()) as client:
        completion = await client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
    message: Any = completion.choices[0].message
    assert message.prompt_token_ids == TOKENIZED["tokens"]
    assert tokenize.call_count == 1
    assert tokenize.calls.last.request.headers["authorization"] == "Bearer sk-test"
    assert json.loads(tokenize.calls.last.request.content) == {"model": "tiny", "messages": MESSAGES}


async def test_capture_failure_reaches_the_sdk_caller_as_the_cause(server: respx.MockRouter) -> None:
    """A conflicting response: the typed error itself (openai 3.x re-raises what is not an httpx error;
    1.x wrapped it as APIConnectionError with the typed error as __cause__), raised once, not retried."""
    response = copy.deepcopy(INLINE)
    response["choices"][0]["token_ids"][0] += 1
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=response))
    async with sdk(TokenCaptureTransport()) as client:
        with pytest.raises(Exception) as raised:
            await client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
    error = raised.value if isinstance(raised.value, TokensError) else raised.value.__cause__
    assert isinstance(error, ConflictingTokenMetadataError)
    assert chat.call_count == 1


async def test_http_errors_and_other_requests_pass_through(server: respx.MockRouter) -> None:
    """A 400 reaches the SDK as its own BadRequestError; GET /models is not touched."""
    error = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    server.post(CHAT).mock(return_value=httpx.Response(400, json=error))
    models = server.get(f"{BASE}/models").mock(
        return_value=httpx.Response(
            200, json={"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "me"}]}
        )
    )
    async with sdk(TokenCaptureTransport(), max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="bad"):
            await client.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
        listed = await client.models.list()
    assert [model.id for model in listed.data] == ["tiny"]
    assert "logprobs" not in models.calls.last.request.url.params


async def test_hostile_answers_through_the_transport(server: respx.MockRouter) -> None:
    """A gzip bomb and a redirect are typed errors raised from the transport, never a completion."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = compressor.compress(bytes(16 * 2**20)) + compressor.flush()
    server.post(CHAT).mock(return_value=httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=bomb))
    async with httpx.AsyncClient(transport=TokenCaptureTransport(max_response_bytes=2**20)) as http:
        with pytest.raises(ResponseTooLargeError):
            await http.post(CHAT, json={"model": "tiny", "messages": MESSAGES})
        server.post(CHAT).mock(return_value=httpx.Response(307, headers={"Location": "http://elsewhere.test/"}))
        with pytest.raises(ServerResponseError, match="HTTP 307 redirect"):
            await http.post(CHAT, json={"model": "tiny", "messages": MESSAGES})
        with pytest.raises(UnsupportedRequestError, match="n=0"):
            await http.post(CHAT, json={"model": "tiny", "messages": MESSAGES, "n": 0})


async def test_inner_transport_and_telemetry(telemetry: TelemetryCapture) -> None:
    """Any inner transport (here httpx.MockTransport) does the I/O; the capture span and counters are TokenClient's."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json=INLINE)

    transport = TokenCaptureTransport(
        httpx.MockTransport(handler), meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider
    )
    async with httpx.AsyncClient(transport=transport, auth=("alice", "pw")) as http:
        answer = await http.post(CHAT, json={"model": "tiny", "messages": MESSAGES})
    assert answer.json()["choices"][0]["message"]["generation_token_ids"] == INLINE["choices"][0]["token_ids"]
    assert seen == ["/v1/chat/completions"]
    [span] = telemetry.spans("tokens.chat_completion")
    assert span.attributes is not None and span.attributes["tokens.source"] == "vllm"
    assert telemetry.value("tokens.capture.source_total", tokens__source="vllm") == 1
    assert base64.b64encode(b"alice:pw").decode() not in str(span.to_json())
