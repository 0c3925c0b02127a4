"""Capture from a streamed chat completion (``stream: true``, server-sent events), or a legacy completion.

Each event is passed on unchanged as soon as it is complete; only the unfinished tail of the bytes
received is held. Per event, the ids and log probabilities of each choice are appended to its lists,
and so are its message's pieces (text, reasoning, tool calls: constant work per event, whatever the
stream's length). At the end the lists are assembled into the shape of a whole response, its
messages whole, and run through the same extraction chain, so a partial, conflicting or truncated
stream raises the same typed error a whole response would; the bundles ride on the final chunk (the
usage chunk, which capture requests) as ``token_bundles``.
Each chunk is decoded once: ``CapturedStream.events()`` hands it on decoded with the event's bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeAlias

import anyio
import httpx
import msgspec

from ._bundle import TokenCompletion
from ._capture import Capture
from ._errors import MalformedResponseError, PartialTokenMetadataError, ResponseTooLargeError
from ._exchange import TokenizeFn
from ._http import read_body

__all__ = [
    "CapturedStream",
    "Event",
    "StreamAccumulator",
    "TokenStream",
    "bundle_fields",
    "capture_stream",
    "open_stream",
    "reasoning_of",
]

_chunk = msgspec.json.Decoder(dict[str, Any])
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # before the stream's own is known
_LEGACY_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

Event: TypeAlias = tuple[bytes, dict[str, Any] | None]
"""One server-sent event of a captured stream, byte for byte as sent on, and its chat completion
chunk decoded (None for ``[DONE]`` and an event without data)."""


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """The reasoning of a chat message or delta as vLLM's reasoning parsers give it: ``reasoning``
    (vLLM 0.10 on) or ``reasoning_content`` (before, and other servers); None without any."""
    for name in ("reasoning", "reasoning_content"):
        value = message.get(name)
        if isinstance(value, str) and value:
            return value
    return None


@dataclass(slots=True)
class _Choice:
    token_ids: list[int] | None = None
    entries: list[Any] | None = None
    finish_reason: Any = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    prompt_token_ids: Any = None  # a legacy completion's, on its choice
    legacy: dict[str, list[Any]] | None = None  # a legacy completion's logprobs lists

    def gather(self, delta: Mapping[str, Any]) -> None:
        """A delta's pieces of the message: its text, its reasoning, its tool calls' parts."""
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.text.append(content)
        thought = reasoning_of(delta)
        if thought:
            self.reasoning.append(thought)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            index = call.get("index", 0) if isinstance(call, dict) else None
            if not isinstance(index, int):  # not a call vLLM sends: left out of the record's message
                continue
            state = self.calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            function = call.get("function")
            function = function if isinstance(function, dict) else {}
            state["id"] = state["id"] or call.get("id") or ""
            state["name"] = state["name"] or function.get("name") or ""
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                state["arguments"].append(arguments)

    def message(self) -> dict[str, Any]:
        """The whole message the deltas made."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
                }
                for _, c in sorted(self.calls.items())
            ]
        return message


@dataclass
class StreamAccumulator:
    """The token fields of a stream's chunks, gathered per choice; ``whole()`` is the equivalent response."""

    max_event_bytes: int
    completions: bool = False
    """A legacy completion's stream (``/v1/completions``: each choice's ``text``, its ``logprobs``
    lists and its ``prompt_token_ids``) instead of a chat completion's."""
    prompt_token_ids: Any = None
    usage: Any = None
    head: dict[str, Any] = field(default_factory=dict)
    choices: dict[int, _Choice] = field(default_factory=dict)
    done: bool = False
    separator: bytes = b""
    _held: list[bytes] = field(default_factory=list)
    _tail: bytes = b""  # the last three bytes held
    _received: int = 0

    def feed(self, data: bytes) -> list[bytes]:
        """The complete events in ``data`` (with what was held before), byte for byte as received.

        A piece in which no event ends is only held (no copy), so an event arriving in many pieces
        costs its length once. The whole stream is bounded too: ``ResponseTooLargeError`` once more
        than ``max_event_bytes`` (the capture's ``max_response_bytes``) arrived in total, as for a
        whole body, so an endless stream neither passes on nor grows the gathered ids for ever."""
        self._received += len(data)
        if self._received > self.max_event_bytes:
            raise ResponseTooLargeError(
                f"stream: over max_response_bytes={self.max_event_bytes:,} in total (events and all); raise "
                "max_response_bytes if streams this long are expected",
                limit=self.max_event_bytes,
            )
        separator = self.separator
        if (
            separator
            and not self._held
            and data.endswith(separator)
            and data.find(separator) == len(data) - len(separator)
        ):
            return [data]  # the common case: the piece is one whole event (its only ending is its last bytes)
        return self._events(data)

    def _events(self, data: bytes) -> list[bytes]:
        held = self._held
        separator = self.separator
        if separator:  # the common case: vLLM's LF LF known, each piece usually one whole event
            edge = self._tail + data[: len(separator) - 1] if held else b""
            if separator not in data and separator not in edge:
                return self._hold(data)  # no event ends in this piece
        else:
            edge = self._tail + data[:3]  # an ending split between pieces
            if not any(end in data or end in edge for end in _EVENT_ENDS):
                return self._hold(data)
        buffer = b"".join([*held, data]) if held else data
        held.clear()
        self._tail = b""
        if not separator:  # vLLM ends events with LF LF; the SSE format allows CR LF CR LF too
            separator = self.separator = b"\r\n\r\n" if b"\r\n\r\n" in buffer else b"\n\n"
        events = buffer.split(separator)
        rest = events.pop()
        if rest:
            self._hold(rest)
        return [event + separator for event in events]

    def _hold(self, piece: bytes) -> list[bytes]:
        self._held.append(piece)
        self._tail = (self._tail + piece[-3:])[-3:]
        return []

    def record(self, event: bytes) -> dict[str, Any] | None:
        """Record one event; its chunk, decoded (None for ``[DONE]`` and an event without data)."""
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return None
            try:
                chunk = _chunk.decode(payload)
            except (msgspec.MsgspecError, RecursionError) as exc:
                raise MalformedResponseError(f"stream: a chunk is not a JSON object ({exc})") from exc
            self._record(chunk)
            return chunk
        return None

    def _record(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {key: chunk.get(key) for key in ("id", "created", "model")}
        prompt = chunk.get("prompt_token_ids")
        if prompt is not None:
            self.prompt_token_ids = prompt
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise MalformedResponseError("stream: a chunk has no 'choices' list")
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise MalformedResponseError(f"stream: choices[{position}] is not an object")
            index = choice.get("index", position)
            key = index if isinstance(index, int) else position
            state = self.choices.get(key)
            if state is None:
                state = self.choices[key] = _Choice()
            ids = choice.get("token_ids")
            if ids is not None:  # a wrong type is kept as it came, for the typed decoding to name
                if state.token_ids is None:
                    state.token_ids = []
                state.token_ids.extend(ids if isinstance(ids, list) else [ids])
            logprobs = choice.get("logprobs")
            if self.completions:
                self._legacy(state, choice, logprobs)
            else:
                content = logprobs.get("content") if isinstance(logprobs, dict) else None
                if content is not None:
                    if state.entries is None:
                        state.entries = []
                    state.entries.extend(content if isinstance(content, list) else [content])
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    state.gather(delta)
            finish = choice.get("finish_reason")
            if finish is not None:
                state.finish_reason = finish
        usage = chunk.get("usage")
        if usage is not None:
            self.usage = usage

    @staticmethod
    def _legacy(state: _Choice, choice: Mapping[str, Any], logprobs: Any) -> None:
        """A legacy completion choice's pieces: its text, its prompt ids (on its first chunk), its
        logprobs lists (each extended; a wrong type kept as it came, for the typed decoding to name)."""
        text = choice.get("text")
        if isinstance(text, str) and text:
            state.text.append(text)
        prompt = choice.get("prompt_token_ids")
        if prompt is not None:
            state.prompt_token_ids = prompt
        if isinstance(logprobs, dict):
            lists = state.legacy = {} if state.legacy is None else state.legacy
            for name in _LEGACY_LOGPROBS:
                value = logprobs.get(name)
                if value is not None:
                    lists.setdefault(name, []).extend(value if isinstance(value, list) else [value])

    def whole(self) -> bytes:
        """The stream as one whole body (a chat completion, or a legacy completion), for extraction."""
        if not self.done:
            raise PartialTokenMetadataError(
                "stream: it ended before 'data: [DONE]' (truncated); the tokens received cannot be trusted"
            )
        if not self.choices:
            raise MalformedResponseError("stream: no chunk carried a choice")
        choices = []
        for index in range(max(self.choices) + 1):
            state = self.choices.get(index, _Choice())
            choice: dict[str, Any] = {"index": index}
            if self.completions:
                choice["text"] = "".join(state.text)
                choice["logprobs"] = state.legacy
                if state.prompt_token_ids is not None:
                    choice["prompt_token_ids"] = state.prompt_token_ids
            else:
                choice["message"] = state.message()
                if state.entries is not None:
                    choice["logprobs"] = {"content": state.entries}
            choice["finish_reason"] = state.finish_reason
            if state.token_ids is not None:
                choice["token_ids"] = state.token_ids
            choices.append(choice)
        head = self.head
        body: dict[str, Any] = {
            "id": head.get("id"),
            "object": "text_completion" if self.completions else "chat.completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": choices,
        }  # vLLM's order
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.usage is not None:
            body["usage"] = self.usage
        try:
            return msgspec.json.encode(body)
        except (TypeError, msgspec.MsgspecError) as exc:  # e.g. a non-finite float: same error as a whole body
            raise MalformedResponseError(f"stream: the chunks do not form a chat completion ({exc})") from exc


def bundle_fields(completion: TokenCompletion) -> list[dict[str, Any]]:
    """The bundles in the message-bundle shape, in choice order (what the final chunk carries)."""
    return [
        {
            "prompt_token_ids": b.prompt_token_ids,
            "generation_token_ids": b.generation_token_ids,
            "generation_log_probs": b.generation_log_probs,
        }
        for b in completion.bundles
    ]


class CapturedStream(httpx.AsyncByteStream):
    """The events of a streamed completion, passed on as they arrive, with the bundles on the final
    chunk; ``completion`` holds them once the stream has ended. Iterated, it gives each event's bytes
    (what an httpx client reads); ``events()`` gives each event with its chunk, decoded once (what
    the capture proxy reads)."""

    def __init__(
        self,
        response: httpx.Response,
        accumulator: StreamAccumulator,
        finish: Callable[[bytes], Awaitable[TokenCompletion]],
    ) -> None:
        self._response = response
        self._accumulator = accumulator
        self._finish = finish
        self.completion: TokenCompletion | None = None

    async def events(self) -> AsyncIterator[Event]:
        """Each complete event as it arrives, with its chunk; the final usage chunk is held and re-encoded
        with ``token_bundles`` once ``finish`` (the extraction chain) has run on the whole stream."""
        accumulator = self._accumulator
        final: dict[str, Any] | None = None
        raw = self._response.aiter_raw()
        async for data in raw:
            for event in accumulator.feed(data):
                chunk = accumulator.record(event)
                if chunk is not None and chunk.get("usage") is not None and not chunk["choices"]:
                    final = chunk  # held: it gets the bundles, which need the [DONE] that follows
                    continue
                if accumulator.done:
                    completion = self.completion = await self._finish(accumulator.whole())
                    if final is None:  # the server sent no usage chunk: the bundles get one of their own
                        kind = "text_completion" if accumulator.completions else "chat.completion.chunk"
                        final = {**accumulator.head, "object": kind, "choices": []}
                    final["token_bundles"] = bundle_fields(completion)
                    yield b"data: " + msgspec.json.encode(final) + accumulator.separator, final
                    yield event, None
                    await _drained(raw)
                    return
                yield event, chunk
        accumulator.whole()  # the stream ended without [DONE]: raises

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for event, _ in self.events():
            yield event

    async def aclose(self) -> None:
        await self._response.aclose()


async def capture_stream(
    response: httpx.Response, sent: Mapping[str, Any], capture: Capture, tokenize: TokenizeFn, max_event_bytes: int
) -> CapturedStream:
    """Capture from a 2xx or 3xx streamed ``response`` to ``sent`` (a redirect raises, as for whole bodies)."""

    async def finish(data: bytes) -> TokenCompletion:
        completion = await capture.complete(sent, partial(_ready, data), tokenize)
        assert completion is not None
        return completion

    return await open_stream(response, finish, max_event_bytes)


async def open_stream(
    response: httpx.Response,
    finish: Callable[[bytes], Awaitable[TokenCompletion]],
    max_event_bytes: int,
    *,
    completions: bool = False,
) -> CapturedStream:
    """The capture of a streamed ``response`` (a chat completion's, or a legacy completion's with
    ``completions``), ``finish`` extracting the bundles from its whole body; an answer that is no 2xx
    stream raises its typed error (a redirect too, as for whole bodies), a compressed one raises."""
    what = "completion stream" if completions else "chat completion stream"
    if not 200 <= response.status_code < 300:
        await read_body(response, what, max_event_bytes)  # raises the typed error
    if response.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        await response.aclose()
        raise MalformedResponseError(f"{what}: the server compressed it although asked not to")
    return CapturedStream(response, StreamAccumulator(max_event_bytes, completions), finish)


async def _drained(raw: AsyncIterator[bytes]) -> None:
    """The rest of a stream's body after its ``[DONE]`` read (its chunked ending, normally in the same
    moment), so that its connection goes back to the pool instead of being closed and a new one
    opened for the next call; what comes after ``[DONE]`` is not passed on. An upstream that sends
    more than ``_DRAIN_BYTES`` or takes longer than ``_DRAIN_S`` has its connection closed, as before."""
    received = 0
    with anyio.move_on_after(_DRAIN_S):
        async for data in raw:
            received += len(data)
            if received > _DRAIN_BYTES:
                return


_DRAIN_BYTES = 2**16
_DRAIN_S = 0.25


async def _ready(data: bytes) -> bytes:
    return data


class TokenStream:
    """A streamed chat completion from ``TokenClient.stream_chat_completion``: iterate for the chunks
    (decoded, as they arrive; the last one carries ``token_bundles``), then read ``completion``."""

    def __init__(self, stream: CapturedStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for _, chunk in self._stream.events():
            if chunk is not None:
                yield chunk

    @property
    def completion(self) -> TokenCompletion:
        """The bundles (``TokenCompletion.bundles``, one per choice) once the stream has been read to its end."""
        if self._stream.completion is None:
            raise RuntimeError("TokenStream.completion: read the stream to its end first (async for chunk in stream)")
        return self._stream.completion
