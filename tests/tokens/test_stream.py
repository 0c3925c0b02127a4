"""Streaming through TokenCaptureTransport: every chunk passed on as it arrives, the bundles on the final chunk."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import httpx
import openai
import pytest
import respx

from tests.token_samples import BASE, CHAT, FIXTURES
from tokens import (
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    ResponseTooLargeError,
    TokenCaptureTransport,
    TokenClient,
    TokensError,
)
from tokens._stream import StreamAccumulator
from tokens._token_in import extract_token_in
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

pytestmark = pytest.mark.anyio

SSE = (FIXTURES / "chat_stream_inline_ids.response.sse").read_bytes()
EVENTS = [event + b"\n\n" for event in SSE.split(b"\n\n") if event.strip()]
CHUNKS = [json.loads(event[6:]) for event in EVENTS if event != b"data: [DONE]\n\n"]
MESSAGES = [{"role": "user", "content": "hi"}]
SSE_HEADERS = {"content-type": "text/event-stream"}


def as_id_tokens(events: list[bytes]) -> list[bytes]:
    """The sample as a capture request gets it (return_tokens_as_token_ids): logprob tokens as token_id:<id>."""
    out = []
    for event in events:
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            for choice in chunk["choices"]:
                if choice.get("logprobs"):
                    for entry, token_id in zip(choice["logprobs"]["content"], choice["token_ids"], strict=True):
                        entry["token"] = f"token_id:{token_id}"
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        out.append(event)
    return out


async def split_badly(events: list[bytes], log: list[str] | None = None) -> AsyncIterator[bytes]:
    """The events, cut at awkward places (inside JSON, between the two newlines)."""
    data = b"".join(events)
    for start in range(0, len(data), 97):
        if log is not None:
            log.append(f"sent {start}")
        yield data[start : start + 97]


async def sdk_stream(events: list[bytes], log: list[str] | None = None) -> list[Any]:
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    chunks = []
    with respx.mock() as router:
        route = router.post(CHAT).mock(
            return_value=httpx.Response(200, headers=SSE_HEADERS, content=split_badly(events, log))
        )
        http = httpx.AsyncClient(transport=transport)
        async with openai.AsyncOpenAI(base_url=BASE, api_key="-", http_client=http, max_retries=0) as client:
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
            async for chunk in stream:
                if log is not None:
                    log.append("received")
                chunks.append(chunk)
    sent = json.loads(route.calls.last.request.content)
    assert sent["stream"] is True and sent["stream_options"]["include_usage"] is True and sent["logprobs"] is True
    return chunks


async def test_sdk_stream_yields_every_chunk_then_the_bundles() -> None:
    chunks = await sdk_stream(as_id_tokens(EVENTS))
    assert len(chunks) == len(CHUNKS)
    for got, sent in zip(chunks[:-1], CHUNKS[:-1], strict=True):
        assert [c.delta.content for c in got.choices] == [c["delta"].get("content") for c in sent["choices"]]
        assert [getattr(c, "token_ids", None) for c in got.choices] == [c.get("token_ids") for c in sent["choices"]]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 4
    [bundle] = final.model_extra["token_bundles"]
    assert bundle["prompt_token_ids"] == CHUNKS[0]["prompt_token_ids"]
    assert bundle["generation_token_ids"] == [i for c in CHUNKS for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert bundle["generation_log_probs"] == [
        e["logprob"] for c in CHUNKS for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])
    ]


async def test_chunks_are_passed_on_as_they_arrive() -> None:
    """The first chunk reaches the caller before the server has sent the rest."""
    log: list[str] = []
    await sdk_stream(as_id_tokens(EVENTS), log)
    assert log.index("received") < len([entry for entry in log if entry.startswith("sent")]) - 1


async def test_real_sample_with_text_tokens() -> None:
    """The recorded stream itself (tokens as text): the inline ids give the bundle."""
    chunks = await sdk_stream(EVENTS)
    [bundle] = chunks[-1].model_extra["token_bundles"]
    assert bundle["generation_token_ids"] == [1069, 654, 350, 831]


async def stream_error(events: list[bytes]) -> BaseException:
    with pytest.raises(Exception) as raised:
        await sdk_stream(events)
    error = raised.value
    return error if isinstance(error, TokensError) else error.__cause__  # type: ignore[return-value]


async def test_conflicting_stream_raises_the_typed_error_through_the_sdk() -> None:
    events = as_id_tokens(EVENTS)
    chunk = json.loads(events[2][6:])
    chunk["choices"][0]["token_ids"] = [999]
    events[2] = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    assert isinstance(await stream_error(events), ConflictingTokenMetadataError)


async def test_truncated_and_malformed_streams() -> None:
    truncated = await stream_error(as_id_tokens(EVENTS)[:-2])
    assert isinstance(truncated, PartialTokenMetadataError) and "before 'data: [DONE]'" in str(truncated)
    events = as_id_tokens(EVENTS)
    chunk = json.loads(events[1][6:])
    chunk["choices"][0]["token_ids"] = [True]
    events[1] = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    assert isinstance(await stream_error(events), MalformedTokenMetadataError)


async def test_token_client_streaming_call() -> None:
    """TokenClient.stream_chat_completion: the chunks as they arrive, then the bundle as the call's result."""
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as client:
        with respx.mock() as router:
            route = router.post(CHAT).mock(
                return_value=httpx.Response(200, headers=SSE_HEADERS, content=split_badly(as_id_tokens(EVENTS)))
            )
            async with client.stream_chat_completion(model="tiny", messages=MESSAGES) as stream:
                with pytest.raises(RuntimeError, match="read the stream to its end first"):
                    _ = stream.completion
                chunks = [chunk async for chunk in stream]
    assert json.loads(route.calls.last.request.content)["stream"] is True
    sent = [json.loads(event[6:]) for event in as_id_tokens(EVENTS)[:-2]]
    assert chunks[:-1] == sent  # unchanged
    assert stream.completion.bundle.generation_token_ids == [1069, 654, 350, 831]
    assert chunks[-1]["token_bundles"][0]["generation_token_ids"] == [1069, 654, 350, 831]


async def test_crlf_events_pass_unchanged() -> None:
    """Events ended with CR LF CR LF (allowed by the SSE format) are recognised and passed on byte for byte."""
    events = [event.replace(b"\n\n", b"\r\n\r\n") for event in as_id_tokens(EVENTS)]
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    with respx.mock() as router:
        router.post(CHAT).mock(return_value=httpx.Response(200, headers=SSE_HEADERS, content=split_badly(events)))
        async with httpx.AsyncClient(transport=transport) as http:
            body = {"model": "tiny", "messages": MESSAGES, "stream": True}
            async with http.stream("POST", CHAT, json=body) as response:
                received = b"".join([part async for part in response.aiter_bytes()])
    final = [e for e in received.split(b"\r\n\r\n") if b"token_bundles" in e]
    assert received.replace(final[0] + b"\r\n\r\n", b"").startswith(b"".join(events[:-2]))
    assert json.loads(final[0][6:])["token_bundles"][0]["generation_token_ids"] == [1069, 654, 350, 831]


async def test_streamed_group_against_the_fake(fake_vllm: FakeVLLM) -> None:
    """n=3 streamed (the fake interleaves nothing: choice after choice): three bundles, one shared prompt."""
    async with TokenClient(FAKE_VLLM_URL + "/v1", request_prompt_and_generation_token_ids=True) as client:
        whole = await client.chat_completion(model="tiny", messages=MESSAGES, n=3, max_tokens=8, seed=4)
        async with client.stream_chat_completion(model="tiny", messages=MESSAGES, n=3, max_tokens=8, seed=4) as stream:
            chunks = [chunk async for chunk in stream]
    streamed = stream.completion
    assert len(streamed.bundles) == 3
    assert [b.generation_token_ids for b in streamed.bundles] == [b.generation_token_ids for b in whole.bundles]
    assert all(b.prompt_token_ids == whole.bundle.prompt_token_ids for b in streamed.bundles)
    assert len(chunks[-1]["token_bundles"]) == 3


async def test_an_event_without_end_is_refused_at_the_limit() -> None:
    """A hostile stream that never ends its event: ResponseTooLargeError once max_response_bytes is passed
    (the bound of the whole stream holds for one event that never ends too)."""

    async def endless() -> AsyncIterator[bytes]:
        yield EVENTS[0]
        while True:
            yield b"x" * 4096

    transport = TokenCaptureTransport(max_response_bytes=2**20)
    with respx.mock() as router:
        router.post(CHAT).mock(return_value=httpx.Response(200, headers=SSE_HEADERS, content=endless()))
        async with httpx.AsyncClient(transport=transport) as http:
            body = {"model": "tiny", "messages": MESSAGES, "stream": True}
            async with http.stream("POST", CHAT, json=body) as response:
                with pytest.raises(ResponseTooLargeError, match="over max_response_bytes=1,048,576 in total"):
                    async for _ in response.aiter_bytes():
                        pass


@pytest.mark.anyio(False)
@pytest.mark.parametrize("ending", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 97])
def test_events_are_found_however_the_bytes_are_cut(ending: bytes, size: int) -> None:
    """Cut into pieces of any size (an ending split over up to four pieces), the events come out whole and unchanged."""
    events = [event.replace(b"\n\n", ending) for event in as_id_tokens(EVENTS)]
    data = b"".join(events)
    accumulator = StreamAccumulator(2**20)
    out: list[bytes] = []
    for start in range(0, len(data), size):
        out += accumulator.feed(data[start : start + size])
    assert out == events


@contextlib.asynccontextmanager
async def sse_server(
    ending: Callable[[anyio.abc.SocketStream], Awaitable[None]],
) -> AsyncIterator[tuple[str, list[anyio.abc.SocketStream]]]:
    """A real HTTP/1.1 server on a loopback port: each request on a connection answered with the sample
    stream, one chunk per event, then ``ending``; its base URL and the connections it accepted."""
    accepted: list[anyio.abc.SocketStream] = []

    async def handle(client: anyio.abc.SocketStream) -> None:
        accepted.append(client)
        buffer = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    buffer += await client.receive()
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                found = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                length = int(found.group(1)) if found else 0
                while len(buffer) < length:
                    buffer += await client.receive()
                buffer = buffer[length:]
                await client.send(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for event in as_id_tokens(EVENTS):
                    await client.send(b"%x\r\n%s\r\n" % (len(event), event))
                await ending(client)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, handle)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        yield f"http://127.0.0.1:{port}/v1", accepted
        group.cancel_scope.cancel()


async def streamed_calls(base: str, calls: int) -> list[bytes]:
    """``calls`` streamed chat completions through the capture transport on one real HTTP transport."""
    transport = TokenCaptureTransport(httpx.AsyncHTTPTransport(), request_prompt_and_generation_token_ids=True)
    received = []
    async with httpx.AsyncClient(transport=transport, timeout=10) as http:
        for _ in range(calls):
            body = {"model": "tiny", "messages": MESSAGES, "stream": True}
            async with http.stream("POST", base + "/chat/completions", json=body) as response:
                received.append(b"".join([part async for part in response.aiter_raw()]))
    return received


async def test_a_streamed_call_leaves_its_connection_to_the_next() -> None:
    """The body's end after ``[DONE]`` is read, so the connection goes back to the pool: three streamed
    calls, one connection (each call opened its own before)."""

    async def end_body(client: anyio.abc.SocketStream) -> None:
        await client.send(b"0\r\n\r\n")

    async with sse_server(end_body) as (base, accepted):
        received = await streamed_calls(base, 3)
    assert len(accepted) == 1
    for stream in received:
        assert stream.startswith(b"".join(as_id_tokens(EVENTS)[:-2])) and stream.endswith(b"data: [DONE]\n\n")
        assert b'"token_bundles"' in stream


@pytest.mark.parametrize("after", ["silence", "endless bytes"])
async def test_what_follows_done_is_not_waited_for_nor_passed_on(after: str) -> None:
    """An upstream that goes silent after ``[DONE]`` without ending its body, or sends bytes without
    end: the stream still ends at once (its connection closed, the next call opens another)."""

    async def hostile(client: anyio.abc.SocketStream) -> None:
        if after == "silence":
            await anyio.sleep_forever()
        while True:
            await client.send(b"1000\r\n" + b"x" * 4096 + b"\r\n")

    async with sse_server(hostile) as (base, accepted):
        with anyio.fail_after(5):
            received = await streamed_calls(base, 2)
    assert len(accepted) == 2
    assert all(stream.endswith(b"data: [DONE]\n\n") and b"xxxx" not in stream for stream in received)


@pytest.mark.anyio(False)
def test_the_whole_answer_holds_the_message_the_deltas_made() -> None:
    """Text, reasoning (either spelling) and tool calls' parts are joined per choice in the whole answer;
    pieces of other types (a tool call's index too) are left out."""
    accumulator = StreamAccumulator(2**20)
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "reasoning_content": "think "},
        {"reasoning": "more", "content": "Hel"},
        {"content": "lo", "tool_calls": [{"index": 1, "id": "c1", "function": {"name": "sh", "arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}, {"index": "x", "function": {"name": "odd"}}]},
        {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "ls", "arguments": "{}"}}], "content": 7},
    ]
    for delta in deltas:
        accumulator.record(b"data: " + json.dumps({"id": "s", "choices": [{"index": 0, "delta": delta}]}).encode())
    accumulator.record(b"data: [DONE]")
    message = json.loads(accumulator.whole())["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Hello",
        "reasoning": "think more",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": '{"a": 1}'}},
        ],
    }


@pytest.mark.parametrize("name", ["completions_stream_inline_ids", "completions_stream_n2"])
@pytest.mark.anyio(False)
def test_a_recorded_legacy_completion_stream_makes_its_whole_completion(name: str) -> None:
    """vLLM's own ``/v1/completions`` stream: each choice's prompt ids (on its first chunk), generated ids,
    log probabilities and text gathered, in order, into the bundles ``extract_token_in`` checks."""
    request = json.loads((FIXTURES / f"{name}.request.json").read_text())
    events = [e for e in (FIXTURES / f"{name}.response.sse").read_bytes().split(b"\n\n") if e.startswith(b"data:")]
    accumulator = StreamAccumulator(2**20, completions=True)
    chunks = [chunk for event in events if (chunk := accumulator.record(event)) is not None]
    completion = extract_token_in(request, accumulator.whole())
    for index, bundle in enumerate(completion.bundles):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert bundle.prompt_token_ids == mine[0]["prompt_token_ids"] and len(bundle.prompt_token_ids) > 0
        assert bundle.generation_token_ids == [token for choice in mine for token in choice["token_ids"]]
        assert bundle.generation_log_probs == [lp for choice in mine for lp in choice["logprobs"]["token_logprobs"]]
        assert completion.response["choices"][index]["text"] == "".join(choice["text"] for choice in mine)
    assert completion.response["object"] == "text_completion" and len(completion.bundles) == request.get("n", 1)


@pytest.mark.anyio(False)
def test_a_legacy_completion_stream_without_logprobs_is_refused_typed() -> None:
    accumulator = StreamAccumulator(2**20, completions=True)
    choice = {"index": 0, "text": "a", "logprobs": None, "prompt_token_ids": [5], "token_ids": [7]}
    accumulator.record(b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode())
    accumulator.record(b"data: [DONE]")
    with pytest.raises(MissingTokenMetadataError, match="logprobs"):
        extract_token_in({"prompt": "a"}, accumulator.whole())
