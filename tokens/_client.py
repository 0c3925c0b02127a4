"""``TokenClient``: chat completions over httpx with the token bundle extracted from the response."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import msgspec
import stamina
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Span, TracerProvider

from _shared_telemetry import ERROR_TYPE_ATTR, Instruments, Tracing, error_type, guarded_span, safely

from ._bundle import TokenBundle, TokenCompletion
from ._chain import DEFAULT_CHAIN, ChainEntry, Exchange, build_chain
from ._decode import decode_response, decode_tokenize
from ._errors import ServerResponseError, UnsupportedRequestError
from ._http import ACCEPT_ENCODING, DEFAULT_MAX_RESPONSE_BYTES, read_body, redact, strip_credentials
from ._telemetry import SCOPE, SOURCE_ATTR, TokenInstruments

__all__ = ["RetryPolicy", "TokenClient", "prepare_request", "server_root"]

# Long generations (32K tokens) take minutes; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
SPAN_NAME = "tokens.chat_completion"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


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


def server_root(base_url: str) -> str:
    """The server root for ``/tokenize``: ``base_url`` without a trailing slash or ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def prepare_request(body: Mapping[str, Any], *, request_token_ids: bool) -> dict[str, Any]:
    """The request as sent: logprobs forced on, one log probability per token, token ids as tokens.

    Refuses (``UnsupportedRequestError``, before anything is sent) ``n`` other than 1 and streaming.
    """
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise UnsupportedRequestError(
            f"n={n!r}: token capture supports one choice per request; send n=1 (or omit it) and "
            "issue separate requests for several samples"
        )
    if body.get("stream"):
        raise UnsupportedRequestError(
            "stream=true: token capture needs the whole response; send stream=false (or omit it)"
        )
    sent = dict(body)
    sent.pop("prompt_logprobs", None)
    sent["logprobs"] = True
    sent["top_logprobs"] = 0
    sent["return_tokens_as_token_ids"] = True
    if request_token_ids:
        sent["return_token_ids"] = True
    return sent


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
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                "TokenClient: base_url must be an http(s) URL such as http://host:8000/v1, "
                f"not {redact(repr(base_url))}"
            )
        if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
            raise ValueError(f"TokenClient: max_response_bytes must be a positive int, not {max_response_bytes!r}")
        base_url, self._auth = strip_credentials(base_url)
        self.base_url = base_url.rstrip("/")
        self.tokenize_url = server_root(base_url) + "/tokenize"
        self.request_prompt_and_generation_token_ids = request_prompt_and_generation_token_ids
        self.retry = retry
        self.max_response_bytes = max_response_bytes
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": ACCEPT_ENCODING}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._owns_client = http_client is None
        # No timeout given: ours for a client we make, the injected client's own for one passed in.
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout or DEFAULT_TIMEOUT)
        self._timeout: Any = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        self._chain = build_chain(DEFAULT_CHAIN if middleware is None else middleware)
        self.allow_tokenize_fallback = allow_tokenize_fallback
        self._instruments = Instruments(TokenInstruments.create, meter_provider, SCOPE)
        self._tracing = Tracing(tracer_provider, SCOPE)

    async def __aenter__(self) -> TokenClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._http.aclose()

    async def _post(self, url: str, body: Mapping[str, Any], what: str) -> bytes:
        """POST ``body``; the raw response bytes on 2xx, a typed error otherwise, retried per policy."""
        request = self._http.build_request(
            "POST", url, content=msgspec.json.encode(body), headers=self._headers, timeout=self._timeout
        )

        async def once() -> bytes:
            auth: Any = self._auth if self._auth is not None else httpx.USE_CLIENT_DEFAULT
            response = await self._http.send(request, stream=True, auth=auth, follow_redirects=False)
            return await read_body(response, what, self.max_response_bytes)

        policy = self.retry
        if policy is None:
            return await once()
        async for attempt in stamina.retry_context(
            on=_retryable(policy),
            attempts=policy.attempts,
            timeout=policy.timeout,
            wait_initial=policy.wait_initial,
            wait_max=policy.wait_max,
            wait_jitter=policy.wait_jitter,
        ):
            with attempt:
                return await once()
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def tokenize(self, body: Mapping[str, Any]) -> list[int]:
        """``POST {server root}/tokenize`` with ``body``; the prompt ids."""
        started = time.perf_counter()
        data = await self._post(self.tokenize_url, body, "/tokenize")
        instruments = self._instruments.get()
        if instruments is not None:
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            safely("tokens.tokenize_fallback.duration_ms", instruments.tokenize_ms.record, elapsed_ms)
        return decode_tokenize(data)

    async def chat_completion(self, **body: Any) -> TokenCompletion:
        """Post a chat completion; the response with its bundle on ``choices[0].message``."""
        request = prepare_request(body, request_token_ids=self.request_prompt_and_generation_token_ids)
        tracer = self._tracing.get()
        if tracer is None:
            return await self._complete(request)
        with guarded_span(tracer, SPAN_NAME) as span:
            completion = await self._complete(request)
            if span is not None:
                safely(SPAN_NAME, _mark_bundle, span, completion.bundle)
            return completion

    async def _complete(self, request: dict[str, Any]) -> TokenCompletion:
        try:
            data = await self._post(self.base_url + "/chat/completions", request, "chat completion")
            return await self.extract(request, data)
        except Exception as exc:
            self._count("errors", {ERROR_TYPE_ATTR: error_type(exc)})
            raise

    async def extract(self, request: Mapping[str, Any], data: bytes | str) -> TokenCompletion:
        """Run a response body through the extraction chain (``/tokenize`` as its fallback)."""
        response = decode_response(data)
        bundle = await self._chain(Exchange(request, response, self.tokenize, self.allow_tokenize_fallback))
        self._count("sources", {SOURCE_ATTR: bundle.source})
        return TokenCompletion(attach_bundle(response.body, bundle), bundle)

    def _count(self, which: str, attributes: dict[str, str]) -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            safely(f"tokens counter {which}", getattr(instruments, which).add, 1, attributes)


def attach_bundle(body: dict[str, Any], bundle: TokenBundle) -> dict[str, Any]:
    """Place ``bundle`` on ``body["choices"][0]["message"]`` (the transport fields are already gone)."""
    message = body["choices"][0]["message"]
    message["prompt_token_ids"] = bundle.prompt_token_ids
    message["generation_token_ids"] = bundle.generation_token_ids
    message["generation_log_probs"] = bundle.generation_log_probs
    if bundle.routed_experts is not None:
        message["routed_experts"] = bundle.routed_experts
        body["choices"][0].pop("routed_experts", None)
    return body


def _mark_bundle(span: Span, bundle: TokenBundle) -> None:
    span.set_attribute(SOURCE_ATTR, bundle.source)
    span.set_attribute("tokens.exact", bundle.exact)
    span.set_attribute("tokens.prompt_count", len(bundle.prompt_token_ids))
    span.set_attribute("tokens.generation_count", len(bundle.generation_token_ids))
    if bundle.floored_positions:
        span.set_attribute("tokens.floored_count", len(bundle.floored_positions))


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
