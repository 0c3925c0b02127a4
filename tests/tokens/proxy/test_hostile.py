"""Hostile upstreams and clients: oversized bodies, malformed events, a stream cut mid-event, a silent
upstream, a slow-loris client, one that stops reading. Each gets a typed error in the client's
dialect that names no upstream, and nothing is left running."""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from pytest_llm_sandbox_middleware import FakeVLLMTransport
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tokens.proxy import ProxyServer, create_app
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

USER = [{"role": "user", "content": "hi"}]
HEAD = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def chunk(text: str, token: int) -> bytes:
    choice = {
        "index": 0,
        "delta": {"content": text},
        "token_ids": [token],
        "finish_reason": None,
        "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": -0.5}]},
    }
    return b"data: " + json.dumps({**HEAD, "choices": [choice]}).encode() + b"\n\n"


FIRST = (
    b"data: "
    + json.dumps(
        {
            **HEAD,
            "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)


class Scripted(httpx.AsyncBaseTransport):
    """An upstream whose chat completion stream is ``pieces`` (bytes, or a float: a pause in seconds)."""

    def __init__(self, pieces: list[bytes | float] | Iterator[bytes | float], status: int = 200) -> None:
        self.pieces = pieces
        self.status = status
        self.closed = threading.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/responses"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(self.status, headers={"content-type": "text/event-stream"}, stream=_Stream(self))


class _Stream(httpx.AsyncByteStream):
    def __init__(self, owner: Scripted) -> None:
        self.owner = owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.owner.pieces:
            if isinstance(piece, float):
                await anyio.sleep(piece)
            else:
                yield piece

    async def aclose(self) -> None:
        self.owner.closed.set()


def serve(transport: httpx.AsyncBaseTransport, **options: Any) -> ProxyServer:
    return ProxyServer(create_app("http://user:s3cret@upstream.internal:9/v1", transport=transport, **options))


def no_upstream_in(text: str) -> None:
    for secret in ("s3cret", "upstream.internal", "fake-vllm.test"):
        assert secret not in text


# -- oversized and slow request bodies -----------------------------------------------------


def test_an_oversized_body_is_413_in_each_dialect() -> None:
    with serve(FakeVLLMTransport(FakeVLLM()), max_request_bytes=2000) as server:
        big = [{"role": "user", "content": "x" * 5000}]
        with pytest.raises(openai.APIStatusError) as chat:
            openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0).chat.completions.create(
                model="tiny", messages=big
            )  # type: ignore[arg-type]
        assert chat.value.status_code == 413 and "max_request_bytes=2,000" in chat.value.message
        with pytest.raises(anthropic.RequestTooLargeError) as messages:
            anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0).messages.create(
                model="tiny", max_tokens=4, messages=big
            )  # type: ignore[arg-type]
        assert messages.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 1000

        answer = httpx.post(server.url + "/v1/responses", content=chunked())
        assert answer.status_code == 413 and answer.json()["error"]["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_400() -> None:
    with serve(FakeVLLMTransport(FakeVLLM())) as server:
        for data in (b"{", b"[1, 2]", b"[" * 50_000):
            answer = httpx.post(server.url + "/v1/chat/completions", content=data)
            assert answer.status_code == 400 and "not a JSON object" in answer.json()["error"]["message"]


def test_a_slow_loris_client_is_answered_408_and_dropped() -> None:
    with serve(FakeVLLMTransport(FakeVLLM()), client_timeout=0.5) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model"'
            )
            answer = b""
            while chunk := sock.recv(65536):  # headers and body may come apart; the server then drops us
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408")
        assert b'"type":"error"' in answer and b"client_timeout=0.5" in answer


# -- upstreams that fail -----------------------------------------------------------------------


def test_a_silent_upstream_is_504_and_an_unreachable_one_502() -> None:
    with socket.socket() as listener:  # accepts connections (the backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        app = create_app(f"http://user:s3cret@127.0.0.1:{port}/v1", upstream_timeout=0.5)
        with ProxyServer(app) as server:
            answer = httpx.post(
                server.base_url("r") + "/messages", json={"model": "t", "max_tokens": 1, "messages": USER}
            )
            assert answer.status_code == 504 and answer.json()["error"]["type"] == "timeout_error"
            assert str(port) not in answer.text and "s3cret" not in answer.text
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with ProxyServer(create_app(f"http://127.0.0.1:{port}/v1")) as server:
        with pytest.raises(openai.APIStatusError) as error:
            openai.OpenAI(base_url=server.base_url(), api_key="k", max_retries=0).responses.create(model="t", input="x")
        assert error.value.status_code == 502 and "connection to the upstream failed" in error.value.message
        assert str(port) not in error.value.message


def test_an_oversized_upstream_answer_and_one_without_ids_are_502(telemetry: TelemetryCapture) -> None:
    with serve(FakeVLLMTransport(FakeVLLM()), max_response_bytes=1000) as server:
        answer = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER})
        assert answer.status_code == 502 and "max_response_bytes=1,000" in answer.json()["error"]["message"]
        no_upstream_in(answer.text)

    class NoIds(FakeVLLMTransport):  # a server that ignores logprobs and return_token_ids
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(await request.aread())
            for name in ("logprobs", "return_token_ids"):
                body.pop(name, None)
            return await super().handle_async_request(httpx.Request("POST", request.url, json=body))

    with (
        serve(NoIds(FakeVLLM()), meter_provider=telemetry.meter_provider) as server,
        pytest.raises(anthropic.APIStatusError) as error,
    ):
        anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=USER
        )  # type: ignore[arg-type]
    assert error.value.status_code == 502 and "MissingTokenMetadataError" in error.value.message
    assert (
        telemetry.value(
            "tokens.proxy.capture_error_total",
            tokens__proxy__dialect="messages",
            error__type="tokens.MissingTokenMetadataError",
        )
        == 1
    )


BROKEN = {
    "malformed": [FIRST, chunk("a", 5), b"data: {not json\n\n", chunk("b", 6)],
    "cut mid-event": [FIRST, chunk("a", 5), chunk("b", 6)[:30]],
    "no [DONE]": [FIRST, chunk("a", 5)],
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_stream_ends_in_an_error_event_in_each_dialect(kind: str) -> None:
    transport = Scripted(BROKEN[kind])
    with serve(transport, upstream_timeout=0.5) as server:
        client = openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0)
        with pytest.raises(openai.APIError) as chat_error:
            list(client.chat.completions.create(model="tiny", messages=USER, stream=True))  # type: ignore[call-overload]
        no_upstream_in(chat_error.value.message)
        events = list(client.responses.create(model="tiny", input="hi", stream=True))
        assert events[-1].type == "error" and events[-1].code in ("upstream_error", "upstream_timeout")
        assert [e.type for e in events[:3]] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        messages = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        with (
            pytest.raises(anthropic.APIStatusError) as messages_error,
            messages.messages.stream(model="tiny", max_tokens=4, messages=USER) as stream,  # type: ignore[arg-type]
        ):
            list(stream)
        no_upstream_in(str(messages_error.value))
    assert transport.closed.is_set()


def legacy_chunk(text: str, token: int, prompt: list[int] | None = None) -> bytes:
    logprobs = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": [text], "top_logprobs": [{text: -0.5}]}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None, "prompt_token_ids": prompt,
              "token_ids": [token]}  # fmt: skip
    event = {"id": "c", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.mark.parametrize(
    "pieces",
    [
        [legacy_chunk("a", 5, [1, 2]), b"data: {not json\n\n"],
        [legacy_chunk("a", 5, [1, 2]), legacy_chunk("b", 6)[:30]],
        [legacy_chunk("a", 5, [1, 2])],
        itertools.chain([legacy_chunk("a", 5, [1, 2])], (legacy_chunk("x" * 200, 5) for _ in range(200_000))),
    ],
    ids=["malformed", "cut mid-event", "no [DONE]", "endless"],
)
def test_a_broken_legacy_completion_stream_ends_in_an_error_event(pieces: list[bytes]) -> None:
    """A streamed ``/v1/completions`` that breaks ends in OpenAI's error event (naming no upstream),
    bounded in total like a chat stream, and the upstream closed."""
    transport = Scripted(pieces)
    with serve(transport, max_response_bytes=2**20, upstream_timeout=0.5) as server:
        client = openai.OpenAI(base_url=server.base_url("r"), api_key="k", max_retries=0)
        with pytest.raises(openai.APIError) as error:
            list(client.completions.create(model="tiny", prompt="hi", stream=True))
    no_upstream_in(error.value.message)
    assert transport.closed.is_set()


def test_an_endless_stream_is_bounded_in_total_by_max_response_bytes() -> None:
    """Each event small, the stream endless: it ends in an error event once max_response_bytes
    arrived in total (it used to pass on for ever, the gathered ids growing), and the upstream is closed."""
    transport = Scripted(itertools.chain([FIRST], (chunk("x" * 200, 5) for _ in range(200_000))))
    with serve(transport, max_response_bytes=2**20) as server:
        request = {"model": "tiny", "messages": USER, "stream": True}
        with httpx.stream("POST", server.url + "/r/r1/v1/chat/completions", json=request, timeout=60) as answer:
            data = b"".join(answer.iter_raw())
    assert len(data) < 2**20 + 2**16
    last = json.loads(data.rstrip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "upstream_error" and "max_response_bytes=1,048,576" in last["error"]["message"]
    assert transport.closed.is_set()


def test_an_upstream_silent_mid_stream_times_out() -> None:
    """A real socket: headers and one event, then silence (httpx's read timeout is the network's)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set():
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                with connection:
                    connection.recv(65536)
                    event = FIRST
                    connection.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
                    )
                    stop.wait(5)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        with ProxyServer(create_app(f"http://127.0.0.1:{port}/v1", upstream_timeout=0.5)) as server:
            events = list(
                openai.OpenAI(base_url=server.base_url(), api_key="k", max_retries=0).responses.create(
                    model="t", input="x", stream=True
                )
            )
        stop.set()
        listener.close()
        thread.join(10)
    assert events[-1].type == "error" and events[-1].code == "upstream_timeout"
    assert str(port) not in events[-1].message


def test_a_client_that_goes_away_mid_stream_closes_the_upstream() -> None:
    transport = Scripted([FIRST, chunk("a", 5), *([1.0] * 30)])
    with serve(transport) as server:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, "stream": True}
        ) as answer:
            next(answer.iter_raw())
        assert transport.closed.wait(5)


def test_a_client_that_stops_reading_is_dropped() -> None:
    def endless() -> Iterator[bytes]:
        yield FIRST
        for index in range(2000):  # 128 MiB if it were all sent: far more than socket buffers hold
            yield chunk("x" * 65536, 5 + index % 200)

    transport = Scripted(endless())
    with serve(transport, client_timeout=0.5) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            body = json.dumps({"model": "tiny", "messages": USER, "stream": True}).encode()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert transport.closed.wait(30)  # never read: the proxy gave up on it and closed the upstream


def test_nothing_is_left_running() -> None:
    before = set(threading.enumerate())
    with serve(FakeVLLMTransport(FakeVLLM())) as server:
        httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER})
    assert set(threading.enumerate()) <= before


# -- the app itself on trio (no server: the ASGI protocol driven by hand) -------------------


def post_scope(path: str) -> dict[str, Any]:
    """The ASGI scope of a JSON ``POST path`` from a loopback client."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


async def call(app: Any, path: str, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    """The status and the body's pieces of one JSON ``POST path`` to the ASGI ``app``."""
    out = await exchange(app, path, body)
    return out[0]["status"], [m["body"] for m in out[1:] if m["body"]]


async def exchange(app: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ASGI messages the ``app`` sends for one JSON ``POST path`` (its start, then its body)."""
    sent = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    out: list[dict[str, Any]] = []
    done = anyio.Event()

    async def receive() -> dict[str, Any]:
        if sent:
            return sent.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        out.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(post_scope(path), receive, send)
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_app_runs_on_asyncio_and_trio(anyio_backend: str) -> None:
    app = create_app(FAKE_VLLM_URL + "/v1", transport=FakeVLLMTransport(FakeVLLM()))
    status, body = await call(app, "/r/r1/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": USER})
    assert status == 200 and json.loads(b"".join(body))["generation_token_ids"]
    status, events = await call(app, "/v1/responses", {"model": "tiny", "input": "hi", "stream": True})
    data = b"".join(events)
    assert status == 200 and data.rstrip().rsplit(b"\n\n", 1)[-1].startswith(b"event: response.completed")
    assert data.count(b"event: response.output_text.delta") > 5
    await app.state.proxy.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_client_gone_before_its_stream_starts_closes_the_upstream(
    anyio_backend: str, telemetry: TelemetryCapture
) -> None:
    """The client hung up while the upstream was answering its headers: the stream's events were
    never produced, and the upstream's stream was left open (vLLM generating for nobody) and the
    call never counted."""
    transport = Scripted([FIRST, chunk("a", 5), *([1.0] * 30)])
    app = create_app("http://upstream.internal:9/v1", transport=transport, meter_provider=telemetry.meter_provider)
    body = json.dumps({"model": "tiny", "messages": USER, "stream": True}).encode()
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop() if sent else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client went away")  # as an ASGI server may say it (ASGI spec 2.4)

    with anyio.fail_after(10):
        await app(post_scope("/v1/chat/completions"), receive, send)
    assert transport.closed.is_set()
    assert telemetry.histogram_count("tokens.proxy.duration_ms") == 1
    await app.state.proxy.aclose()
