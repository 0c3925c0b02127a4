"""``TokenClient``: chat completions over httpx with the token bundle extracted from the response."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import httpx
import msgspec
import stamina
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from ._bundle import TokenCompletion
from ._capture import server_root
from ._chain import ChainEntry
from ._errors import ServerResponseError
from ._http import ACCEPT_ENCODING, DEFAULT_MAX_RESPONSE_BYTES, check_limit, read_body, redact, strip_credentials
from ._stream import TokenStream, capture_stream
from ._token_in import extract_generate, extract_token_in, prepare_generate, prepare_token_in
from ._transport import TokenCaptureTransport
from .records._coordinates import Coordinates
from .records._writer import custody

__all__ = ["RetryPolicy", "TokenClient"]

# Long generations (32K tokens) take minutes; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_NO_HEADERS: Mapping[str, str] = {}


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures (connection errors, 429, 500, 502, 503, 504) are retried, with stamina.

    A 429's Retry-After is honoured (capped at ``wait_max``); a 400 is never retried.
    """

    attempts: int = 3
    timeout: float = 120.0
    wait_initial: float = 0.5
    wait_max: float = 10.0
    wait_jitter: float = 0.5


class _Pool(httpx.AsyncBaseTransport):
    """The client's way out: a request sent through its ``httpx.AsyncClient`` (its pool, its timeout),
    with its credentials, never following a redirect; the response's body is read by the caller."""

    def __init__(self, http: httpx.AsyncClient, auth: Any) -> None:
        self.http = http
        self.auth: Any = auth if auth is not None else httpx.USE_CLIENT_DEFAULT

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.http.send(request, stream=True, auth=self.auth, follow_redirects=False)


class TokenClient:
    """An async client for OpenAI-compatible chat completions that returns exact token bundles.

    ``await client.chat_completion(**body)`` posts ``{base_url}/chat/completions`` with logprobs
    forced on (and ``return_token_ids`` when ``request_prompt_and_generation_token_ids``), then runs
    the response through the extraction chain (``middleware``, default ``DEFAULT_CHAIN``: a bundle
    on the message, vLLM inline ids, logprobs plus ``/tokenize``). ``/tokenize`` on the server
    root is the only other request, and only when no inline source gave the prompt ids.

    Pass ``http_client`` to share a pool (it is not closed by this client; its timeout applies
    unless ``timeout`` is given). The default timeout allows long generations (600 s, 10 s to
    connect). Transient failures
    are retried per ``retry`` (``None`` disables retries). When inline ids were requested but the
    server sent none, ``TokenIdsIgnoredError`` is raised unless ``allow_tokenize_fallback``.

    Hostile servers: each body (completion and ``/tokenize``) is read up to ``max_response_bytes``
    after decompression (``ResponseTooLargeError`` beyond; default 64 MiB, see
    ``DEFAULT_MAX_RESPONSE_BYTES``); a redirect is a ``ServerResponseError``, never followed; a
    ``user:password@`` in ``base_url`` is sent as basic auth and never appears in a URL, a message,
    a span or a log.

    Telemetry (``meter_provider`` / ``tracer_provider``, default the global ones):
    ``tokens.capture.source_total`` by ``tokens.source``, ``tokens.capture.error_total`` by
    ``error.type``, ``tokens.tokenize_fallback.duration_ms``, and a ``tokens.chat_completion`` span
    with the source and the token counts.

    ``sink`` (a ``tokens.records`` store, or any ``TokenSink``): a call given ``rollout_id=`` (and
    optionally ``model_call_id=``, ``parent_call_id=``, ``weight_version=``) among its fields is
    written as a record before the call returns; those fields are not sent. ``weight_version`` is
    the policy version recorded when neither the call nor the server gives one.

    Like httpx's client on its transport, a ``TokenClient`` is a ``TokenCaptureTransport`` (the
    capture and the recorded-call path) over its HTTP client, plus retries, the URLs and the
    token-in endpoints.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        request_prompt_and_generation_token_ids: bool = False,
        middleware: Sequence[ChainEntry] | None = None,
        timeout: httpx.Timeout | float | None = None,
        retry: RetryPolicy | None = RetryPolicy(),
        allow_tokenize_fallback: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
        sink: Any = None,
        weight_version: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                "TokenClient: base_url must be an http(s) URL such as http://host:8000/v1, "
                f"not {redact(repr(base_url))}"
            )
        self.max_response_bytes = check_limit("TokenClient", max_response_bytes)
        base_url, auth = strip_credentials(base_url)
        self.base_url = base_url.rstrip("/")
        self.tokenize_url = server_root(base_url) + "/tokenize"
        self.request_prompt_and_generation_token_ids = request_prompt_and_generation_token_ids
        self.retry = retry
        headers = {"Content-Type": "application/json", "Accept-Encoding": ACCEPT_ENCODING}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # Built once, not per call: the headers normalized, the completion URL parsed (when it parses;
        # one that does not fails at its call, as httpx fails it).
        self._headers = httpx.Headers(headers)
        self._stream_headers = httpx.Headers({**headers, "Accept-Encoding": "identity"})
        self._chat_url = _parsed(self.base_url + "/chat/completions")
        self._owns_client = http_client is None
        # No timeout given: ours for a client we make, the injected client's own for one passed in.
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout or DEFAULT_TIMEOUT)
        self._timeout: Any = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        self._pool = _Pool(self._http, auth)
        self._transport = TokenCaptureTransport(
            self._pool,
            request_prompt_and_generation_token_ids=request_prompt_and_generation_token_ids,
            middleware=middleware,
            allow_tokenize_fallback=allow_tokenize_fallback,
            max_response_bytes=max_response_bytes,
            meter_provider=meter_provider,
            tracer_provider=tracer_provider,
            sink=sink,
            weight_version=weight_version,
        )
        self._capture = self._transport.capture

    async def __aenter__(self) -> TokenClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._http.aclose()

    async def _post(self, url: httpx.URL | str, body: Mapping[str, Any], what: str) -> bytes:
        """POST ``body``; the raw response bytes on 2xx, a typed error otherwise, retried per policy."""
        request = self._http.build_request(
            "POST", url, content=msgspec.json.encode(body), headers=self._headers, timeout=self._timeout
        )

        async def once() -> bytes:
            response = await self._pool.handle_async_request(request)
            return await read_body(response, what, self.max_response_bytes)

        policy = self.retry
        if policy is None:
            return await once()
        # The first attempt runs bare (no retry context on the success path); its failure is
        # replayed as stamina's first attempt, which decides on retrying as it always did.
        started = time.monotonic()
        try:
            return await once()
        except Exception as exc:
            first = exc
        remaining = max(policy.timeout - (time.monotonic() - started), 1e-6)
        async for attempt in stamina.retry_context(
            on=_retryable(policy),
            attempts=policy.attempts,
            timeout=remaining,
            wait_initial=policy.wait_initial,
            wait_max=policy.wait_max,
            wait_jitter=policy.wait_jitter,
        ):
            with attempt:
                if attempt.num == 1:
                    raise first
                return await once()
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def tokenize(self, body: Mapping[str, Any]) -> list[int]:
        """``POST {server root}/tokenize`` with ``body``; the prompt ids."""
        return await self._capture.tokenize(self._post, self.tokenize_url, body)

    async def chat_completion(self, **body: Any) -> TokenCompletion:
        """Post a chat completion; the response with each choice's bundle on its message."""
        coordinates, _, body = self._transport.coordinates(_NO_HEADERS, body)
        request = self._capture.prepare(body)
        fetch = partial(self._post, self._chat_url, request, "chat completion")
        completion = await self._transport.complete(body, request, coordinates, fetch, self.tokenize)
        assert completion is not None  # _post raises on every answer it does not return
        return completion

    async def _token_in(
        self, url: str, what: str, request: dict[str, Any], coordinates: Coordinates | None, extract: Any
    ) -> TokenCompletion:
        async with custody(self._transport.records, coordinates) as call:
            completion: TokenCompletion = extract(request, await self._post(url, request, what))
            await call.write_token_in(completion)
        return completion

    async def completion(self, prompt_token_ids: list[int], **body: Any) -> TokenCompletion:
        """A token-in ``/v1/completions`` call: ``prompt_token_ids`` as the prompt; the bundles (one per
        choice) placed on each choice. The server's echoed prompt ids must equal those sent
        (``ConflictingTokenMetadataError`` says where they differ)."""
        coordinates, _, body = self._transport.coordinates(_NO_HEADERS, body)
        request = prepare_token_in(prompt_token_ids, body)
        return await self._token_in(
            self.base_url + "/completions", "token-in completion", request, coordinates, extract_token_in
        )

    async def generate(self, prompt_token_ids: list[int], **body: Any) -> TokenCompletion:
        """vLLM's token-in ``/inference/v1/generate`` (served with ``--enable-scale-out``):
        ``prompt_token_ids`` in, ``sampling_params`` in ``body``; each choice's bundle carries the
        server's ``weight_versions`` spans (which policy version sampled which tokens). The URL is
        the server root's ``/inference/v1/generate``, whatever ``base_url``'s ``/v1``."""
        coordinates, _, body = self._transport.coordinates(_NO_HEADERS, body)
        request = prepare_generate(prompt_token_ids, body)
        url = server_root(self.base_url) + "/inference/v1/generate"
        return await self._token_in(url, "generate", request, coordinates, extract_generate)

    @contextlib.asynccontextmanager
    async def stream_chat_completion(self, **body: Any) -> AsyncIterator[TokenStream]:
        """Stream a chat completion (``stream: true`` is set): ``async with`` it, iterate the chunks
        as they arrive, then read ``stream.completion`` for the bundles. Not retried."""
        request = self._capture.prepare({**body, "stream": True}, streaming=True)
        sent = self._http.build_request(
            "POST",
            self._chat_url,
            content=msgspec.json.encode(request),
            headers=self._stream_headers,
            timeout=self._timeout,
        )
        response = await self._pool.handle_async_request(sent)
        try:
            yield TokenStream(
                await capture_stream(response, request, self._capture, self.tokenize, self.max_response_bytes)
            )
        finally:
            await response.aclose()

    async def extract(self, request: Mapping[str, Any], data: bytes | str) -> TokenCompletion:
        """Run a response body through the extraction chain (``/tokenize`` as its fallback)."""
        return await self._capture.extract(request, data, self.tokenize)


def _parsed(url: str) -> httpx.URL | str:
    try:
        return httpx.URL(url)
    except httpx.InvalidURL:
        return url


def _retryable(policy: RetryPolicy) -> Any:
    def on(exc: Exception) -> bool | float | dt.timedelta:
        if isinstance(exc, httpx.TransportError):
            return True
        if isinstance(exc, ServerResponseError) and exc.status_code in RETRY_STATUSES:
            if exc.retry_after is not None:
                return min(exc.retry_after, policy.wait_max)
            return True
        return False

    return on
