"""tokens.testing.FakeVLLMServer: the fake over real HTTP on a loopback port, with the recorded vLLM 0.32
field sets, real chunked streams, and TokenClient, the openai SDK and the capture proxy in front of it."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import stamina

from tests.token_samples import FIXTURES, RECORDED_EXCHANGES, keys, recorded_request, sample
from tokens import ContextLengthExceededError, TokenCaptureTransport, TokenClient
from tokens.testing import FakeTokenizer, FakeVLLM, FakeVLLMServer

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Oslo?"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def address(server: FakeVLLMServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.fixture
def served() -> Iterator[FakeVLLMServer]:
    with FakeVLLMServer() as server:
        yield server


@pytest.mark.parametrize(("name", "path"), RECORDED_EXCHANGES)
@pytest.mark.anyio(False)
def test_served_bodies_have_the_recorded_field_sets(served: FakeVLLMServer, name: str, path: str) -> None:
    real, request = sample(f"{name}.response"), recorded_request(name, FakeTokenizer.VOCAB_SIZE)
    answer = httpx.post(served.url + path, json=request)
    assert answer.status_code == (400 if name.startswith("error") else 200)
    assert answer.headers["content-type"] == "application/json"
    assert keys(answer.json()) == keys(real)


@pytest.mark.anyio(False)
def test_a_stream_arrives_one_event_per_chunk_with_the_recorded_field_sets() -> None:
    """Each event is an HTTP chunk of its own (httpx's raw reads are the chunks), and the events' field
    sets are the recorded stream's."""
    real = [
        json.loads(e[6:])
        for e in (FIXTURES / "chat_stream_inline_ids.response.sse").read_bytes().split(b"\n\n")
        if e.startswith(b"data: {")
    ]
    with FakeVLLMServer(stream_delay_s=0.01) as server, httpx.Client() as client:
        request = sample("chat_stream_inline_ids.request")
        with client.stream("POST", server.base_url + "/chat/completions", json=request) as answer:
            assert answer.headers["transfer-encoding"] == "chunked" and "content-length" not in answer.headers
            assert answer.headers["content-type"].startswith("text/event-stream")
            pieces = list(answer.iter_raw())
    assert all(piece.startswith(b"data: ") and piece.count(b"\n\n") == 1 for piece in pieces)
    events = b"".join(pieces).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    fake = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert [keys(chunk) for chunk in fake] == [keys(chunk) for chunk in real]
    assert len(pieces) == len(fake) + 1  # one chunk per event, [DONE] included


async def test_token_client_over_loopback(telemetry: Any) -> None:
    """Inline ids, the /tokenize fallback (same prompt ids), n=3, a stream, a context-length error and
    a scripted 503 retried: what a user sees from TokenClient against the served fake."""
    fake = FakeVLLM(max_model_len=256)
    fake.reply_error(503, retry_after=0)
    with FakeVLLMServer(fake) as server, stamina.set_testing(True, attempts=3):
        async with TokenClient(server.base_url, request_prompt_and_generation_token_ids=True) as client:
            inline = await client.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8)
            group = await client.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8, n=3)
            async with client.stream_chat_completion(model="tiny", messages=MESSAGES, max_tokens=8) as stream:
                chunks = [chunk async for chunk in stream]
            with pytest.raises(ContextLengthExceededError, match="maximum context length is 256"):
                await client.chat_completion(model="tiny", messages=[{"role": "user", "content": "x" * 300}])
        async with TokenClient(server.base_url) as fallback:
            reconstructed = await fallback.chat_completion(model="tiny", messages=MESSAGES, max_tokens=8)
    paths = [path for path, _ in fake.requests]
    assert paths[:2] == ["/v1/chat/completions"] * 2  # the 503, then its retry
    assert inline.bundle.source == "vllm" and reconstructed.bundle.source == "tokenize"
    assert reconstructed.bundle.prompt_token_ids == inline.bundle.prompt_token_ids
    assert len({tuple(b.generation_token_ids) for b in group.bundles}) == 3
    assert len(chunks) > 3 and stream.completion.bundle.prompt_token_ids == inline.bundle.prompt_token_ids


async def test_the_openai_sdk_over_loopback_whole_streamed_and_a_tool_call(served: FakeVLLMServer) -> None:
    served.fake.reply("It is noon.", "It is noon.")
    served.fake.reply_tool_call("get_time", {"tz": "Europe/Oslo"})
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    async with openai.AsyncOpenAI(
        base_url=served.base_url, api_key="-", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
    ) as sdk:
        whole = await sdk.chat.completions.create(model="tiny", messages=MESSAGES)  # type: ignore[arg-type]
        stream = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        text, bundles = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            bundles = (chunk.model_extra or {}).get("token_bundles") or bundles
        called = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200)  # type: ignore[arg-type]
        [model] = (await sdk.models.list()).data
    message: Any = whole.choices[0].message
    assert message.content == text == "It is noon."
    assert FakeTokenizer().decode(message.generation_token_ids) == "It is noon.<|im_end|>"
    [bundle] = bundles or []
    assert bundle["generation_token_ids"] == message.generation_token_ids
    assert bundle["prompt_token_ids"] == message.prompt_token_ids
    [call] = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "Europe/Oslo"}  # type: ignore[union-attr]
    assert model.id == "tiny"


async def test_the_capture_proxy_in_front_of_the_served_fake(served: FakeVLLMServer) -> None:
    """The proxy's upstream is the served fake: the Responses API and a streamed chat through the openai
    SDK, and Anthropic Messages as plain HTTP (no anthropic SDK), each with the fake's ids."""
    pytest.importorskip("starlette", reason="the proxy extra: pip install -e '.[proxy]'")
    from tokens.proxy import ProxyServer, create_app

    served.fake.reply("It is noon.", "Streamed.", "Hello.")
    with ProxyServer(create_app(served.base_url)) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy.base_url("rollout-1"), api_key="-", max_retries=0) as sdk:
            response = await sdk.responses.create(model="tiny", input="Time?", max_output_tokens=64)
            stream = await sdk.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
            chunks = [chunk async for chunk in stream]
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            hi = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
            message = await http.post("/v1/messages", json=hi)
    tokens = response.output[-1].model_extra or {}
    assert response.output_text == "It is noon."
    assert FakeTokenizer().decode(tokens["generation_token_ids"]) == "It is noon.<|im_end|>"
    [bundle] = [b for chunk in chunks for b in (chunk.model_extra or {}).get("token_bundles") or []]
    assert FakeTokenizer().decode(bundle["generation_token_ids"]) == "Streamed.<|im_end|>"
    assert message.status_code == 200 and message.json()["content"] == [{"type": "text", "text": "Hello."}]
    assert FakeTokenizer().decode(message.json()["generation_token_ids"]) == "Hello.<|im_end|>"
    # vLLM's own /v1/responses first: the fake has none (a 404), so the proxy converts to chat completions
    assert [path for path, _ in served.fake.requests] == ["/v1/responses", *["/v1/chat/completions"] * 3]


@pytest.mark.anyio(False)
def test_hostile_and_odd_requests_get_an_error_body(served: FakeVLLMServer) -> None:
    """A body the fake cannot serve is a 500 in vLLM's error shape (not a dropped connection), an
    unknown route a 404, a body without a length a 411, one over the limit a 413; the connection
    stays usable after a JSON error."""
    with httpx.Client(base_url=served.url) as client:
        crashed = client.post("/v1/chat/completions", json={"messages": [1]})
        assert crashed.status_code == 500 and "cannot serve this request" in crashed.json()["error"]["message"]
        assert client.post("/v1/chat/completions", content=b"{").status_code == 400
        assert client.get("/nothing").status_code == 404
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"  # the same connection, kept alive
    with socket.create_connection(address(served)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 411 ")
    with socket.create_connection(address(served)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert raw.recv(4096).startswith(b"HTTP/1.1 413 ")


@pytest.mark.anyio(False)
def test_leaving_the_block_closes_open_connections_and_threads() -> None:
    """An idle keep-alive connection and a stream still being sent do not keep the server's threads."""
    before = set(threading.enumerate())
    with FakeVLLMServer(stream_delay_s=5) as server:
        idle = httpx.Client()
        idle.get(server.base_url + "/models")
        streaming = httpx.Client()
        request = streaming.build_request(
            "POST", server.base_url + "/chat/completions", json={"model": "tiny", "messages": MESSAGES, "stream": True}
        )
        answer = streaming.send(request, stream=True)
        pieces = answer.iter_raw()
        next(pieces)  # the first event arrived; the next is 5 s away
    assert set(threading.enumerate()) <= before
    with pytest.raises(httpx.RemoteProtocolError):  # the stream was cut, not ended
        list(pieces)
    idle.close()
    streaming.close()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url


@pytest.mark.anyio(False)
def test_a_client_that_resets_its_connection_is_not_reported(capfd: pytest.CaptureFixture[str]) -> None:
    """A client gone with a reset (a proxy closing its keep-alive connections) prints nothing; the
    server goes on serving."""
    with FakeVLLMServer() as server:
        raw = socket.create_connection(address(server))
        raw.sendall(b"GET /v1/mod")  # half a request line: the server is reading it
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()  # a reset, not a close
        assert httpx.get(server.base_url + "/models").status_code == 200
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.anyio(False)
def test_an_ipv6_loopback_address_is_served() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with FakeVLLMServer(host="::1") as server:
        assert server.url.startswith("http://[::1]:")
        assert httpx.get(server.base_url + "/models").json()["data"][0]["id"] == "tiny"
