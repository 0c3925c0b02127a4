"""``TokenCaptureTransport``: token capture inside any httpx-based client, the OpenAI SDK included."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import httpx
import msgspec
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from ._bundle import TokenCompletion
from ._capture import Capture, server_root
from ._chain import ChainEntry
from ._exchange import TokenizeFn
from ._http import ACCEPT_ENCODING, DEFAULT_MAX_RESPONSE_BYTES, check_limit, read_body
from ._stream import capture_stream
from .records._coordinates import Coordinates, take_coordinates
from .records._writer import RecordWriter, custody, refuse_unrecordable

__all__ = ["TokenCaptureTransport"]

CHAT_PATH = "/chat/completions"
BODY_EXTENSION = "tokens.body"
"""A chat completion request built with ``extensions={BODY_EXTENSION: body}`` (a dict) is taken as
``body`` as it is, its content not decoded (the capture proxy's: it holds the decoded body already,
and a large body decoded twice cost a second copy of its whole tree)."""
STREAM_EXTENSION = "tokens.stream"
"""A streamed chat completion's response carries its ``CapturedStream`` in ``extensions`` under this
key: its ``events()`` give each event with its chunk decoded (the capture proxy's: it converts the
chunks the capture decoded already, instead of decoding each event a second time)."""
# Headers of the server's answer that describe bytes we replace (the body is re-encoded, uncompressed).
_BODY_HEADERS = ("content-encoding", "content-length", "transfer-encoding")


class TokenCaptureTransport(httpx.AsyncBaseTransport):
    """An httpx transport that captures token bundles from the chat completions passing through it.

    ``inner`` (default: a plain ``httpx.AsyncHTTPTransport``) does the I/O. On a ``POST .../chat/completions``
    the request is prepared as ``TokenClient`` prepares it (logprobs forced on, ``return_token_ids``
    with ``request_prompt_and_generation_token_ids``) and the answer goes through the same
    extraction chain (same machinery, same options, same telemetry). The response handed back
    carries each choice's bundle on its message (``prompt_token_ids``, ``generation_token_ids``,
    ``generation_log_probs``) with the transport fields removed, so the OpenAI SDK's
    ``completion.choices[0].message.generation_token_ids`` holds the exact ids. ``/tokenize``, when
    the fallback is needed, goes through ``inner`` with the request's headers (its credentials).

    Everything else passes through untouched, and so does an HTTP error answer to a completion
    (4xx, 5xx), for the client to raise and retry as it always does; a redirect is refused
    (``ServerResponseError``), never followed. A capture failure is raised from the transport as
    the typed ``tokens`` error: the openai SDK tested here (3.x) re-raises it to the caller as it
    is, not retried; older ones (1.x) wrapped any transport exception as
    ``openai.APIConnectionError`` whose ``__cause__`` is that error, after their retries.
    ``stream: true`` is captured too: chunks pass as they arrive, the bundles ride on the final one.

    ``sink`` (a ``tokens.records`` store, or any ``TokenSink``): each completion that carries a
    rollout id (header ``X-Rollout-Id`` or body field ``rollout_id``; see ``tokens.records``) is
    written as a record, put before the response is handed back; the coordinate headers and
    fields never reach the server. ``weight_version`` is the policy version recorded when neither
    the request nor the server gives one. Streaming and ``n`` > 1 are refused for recorded calls.
    """

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport | None = None,
        *,
        request_prompt_and_generation_token_ids: bool = False,
        middleware: Sequence[ChainEntry] | None = None,
        allow_tokenize_fallback: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        sink: Any = None,
        weight_version: str | None = None,
    ) -> None:
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()
        self.max_response_bytes = check_limit("TokenCaptureTransport", max_response_bytes)
        self.capture = Capture(
            request_token_ids=request_prompt_and_generation_token_ids,
            middleware=middleware,
            allow_tokenize_fallback=allow_tokenize_fallback,
            meter_provider=meter_provider,
            tracer_provider=tracer_provider,
        )
        self.records = None if sink is None else RecordWriter(sink, weight_version=weight_version)
        """The record writer (with ``sink``), or None."""

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith(CHAT_PATH):
            return await self.inner.handle_async_request(request)
        body = request.extensions.get(BODY_EXTENSION)
        if not isinstance(body, dict):
            try:
                body = msgspec.json.decode(await request.aread())
            except (msgspec.MsgspecError, RecursionError):
                return await self.inner.handle_async_request(request)  # not JSON: the server will say so
            if not isinstance(body, dict):
                return await self.inner.handle_async_request(request)
        streaming = bool(body.get("stream"))
        coordinates, request_headers, body = self.coordinates(request.headers, body)
        sent = self.capture.prepare(body, streaming=streaming)
        headers = {k: v for k, v in request_headers.items() if k.lower() not in ("content-length", "accept-encoding")}
        headers["accept-encoding"] = "identity" if streaming else ACCEPT_ENCODING
        extensions = {key: value for key, value in request.extensions.items() if key != BODY_EXTENSION}
        prepared = httpx.Request(
            "POST", request.url, headers=headers, content=msgspec.json.encode(sent), extensions=extensions
        )
        url = request.url

        async def tokenize(body: Mapping[str, Any]) -> list[int]:  # the URL is worked out only when needed
            root = server_root(str(url.copy_with(query=None))[: -len(CHAT_PATH)])
            return await self.capture.tokenize(partial(self._post, headers), root + "/tokenize", body)

        if streaming:
            return await self._stream(sent, prepared, tokenize)
        answer: list[httpx.Response] = []

        async def fetch() -> bytes | None:
            response = await self.inner.handle_async_request(prepared)
            response.request = prepared
            answer.append(response)
            if response.status_code >= 400:
                return None  # the client raises (and retries) HTTP errors as it always does
            return await read_body(response, "chat completion", self.max_response_bytes)

        completion = await self.complete(
            body, sent, coordinates, fetch, tokenize, lambda: answer[0].headers.get("x-weight-version")
        )
        response = answer[0]
        if completion is None:
            return response
        kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        return httpx.Response(
            response.status_code,
            headers=kept,
            content=msgspec.json.encode(completion.response),
            extensions=response.extensions,
        )

    def coordinates(
        self, headers: Mapping[str, str], body: dict[str, Any]
    ) -> tuple[Coordinates | None, Mapping[str, str], dict[str, Any]]:
        """A call's record coordinates (with a sink, when it names a rollout), and its headers and body
        without them; a recorded call must be one non-streamed choice (``UnsupportedRequestError``)."""
        if self.records is None:
            return None, headers, body
        coordinates, kept_headers, kept_body = take_coordinates(headers, body)
        if coordinates is not None:
            refuse_unrecordable(kept_body)
        return coordinates, kept_headers, kept_body

    async def complete(
        self,
        body: Mapping[str, Any],
        sent: Mapping[str, Any],
        coordinates: Coordinates | None,
        fetch: Callable[[], Awaitable[bytes | None]],
        tokenize: TokenizeFn,
        server_version: Callable[[], str | None] = lambda: None,
    ) -> TokenCompletion | None:
        """The recorded-call path of ``TokenClient`` and this transport: the call in custody (begun,
        then recorded or marked incomplete), ``fetch``-ed, its bundles extracted; None when ``fetch``
        passes the answer on untouched."""
        async with custody(self.records, coordinates) as call:
            completion = await self.capture.complete(sent, fetch, tokenize)
            if completion is not None:
                await call.write_chat(body, completion, server_version())
        return completion

    async def _stream(self, sent: dict[str, Any], prepared: httpx.Request, tokenize: TokenizeFn) -> httpx.Response:
        response = await self.inner.handle_async_request(prepared)
        response.request = prepared
        if response.status_code >= 400:
            return response  # the client raises (and retries) HTTP errors as it always does
        stream = await capture_stream(response, sent, self.capture, tokenize, self.max_response_bytes)
        kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        extensions = {**response.extensions, STREAM_EXTENSION: stream}
        return httpx.Response(response.status_code, headers=kept, stream=stream, extensions=extensions)

    async def _post(self, headers: Mapping[str, str], url: str, body: Mapping[str, Any], what: str) -> bytes:
        request = httpx.Request("POST", url, headers=headers, content=msgspec.json.encode(body))
        response = await self.inner.handle_async_request(request)
        response.request = request
        return await read_body(response, what, self.max_response_bytes)
