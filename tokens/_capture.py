"""The capture machinery shared by ``TokenClient`` and ``TokenCaptureTransport``.

One ``Capture`` holds what a capture needs besides HTTP: how the request is prepared, the
extraction chain, the ``/tokenize`` fallback's bookkeeping and the telemetry. The two front ends
differ only in how bytes travel (an ``httpx.AsyncClient`` with retries, or an inner transport),
which they pass in as ``fetch`` (the completion's body) and ``post`` (for ``/tokenize``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Span, TracerProvider

from _shared_telemetry import ERROR_TYPE_ATTR, Instruments, Tracing, error_type, guarded_span, safely

from ._bundle import TokenBundle, TokenCompletion
from ._chain import DEFAULT_CHAIN, ChainEntry, Exchange, build_chain
from ._decode import decode_response, decode_tokenize
from ._errors import UnsupportedRequestError
from ._telemetry import SCOPE, SOURCE_ATTR, TokenInstruments

__all__ = ["Capture", "Post", "attach_bundle", "prepare_request", "server_root"]

SPAN_NAME = "tokens.chat_completion"

Post = Callable[[str, Mapping[str, Any], str], Awaitable[bytes]]
"""``post(url, body, what)``: the 2xx body of a JSON POST (bounded), or a typed error."""


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


class Capture:
    """Request preparation, extraction, ``/tokenize`` fallback and telemetry for one front end."""

    def __init__(
        self,
        *,
        request_token_ids: bool,
        middleware: Sequence[ChainEntry] | None,
        allow_tokenize_fallback: bool,
        meter_provider: MeterProvider | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        self.request_token_ids = request_token_ids
        self.allow_tokenize_fallback = allow_tokenize_fallback
        self._chain = build_chain(DEFAULT_CHAIN if middleware is None else middleware)
        self._instruments = Instruments(TokenInstruments.create, meter_provider, SCOPE)
        self._tracing = Tracing(tracer_provider, SCOPE)

    def prepare(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return prepare_request(body, request_token_ids=self.request_token_ids)

    async def complete(
        self, request: Mapping[str, Any], fetch: Callable[[], Awaitable[bytes | None]], tokenize: Callable[
            [Mapping[str, Any]], Awaitable[list[int]]]
    ) -> TokenCompletion | None:  # fmt: skip
        """Fetch the completion's body and extract its bundle, in a ``tokens.chat_completion`` span.

        ``fetch`` returns None when the front end passes the answer on untouched (an HTTP error
        for the OpenAI SDK to raise); then nothing is extracted and None is returned.
        """
        tracer = self._tracing.get()
        if tracer is None:
            return await self._complete(request, fetch, tokenize)
        with guarded_span(tracer, SPAN_NAME) as span:
            completion = await self._complete(request, fetch, tokenize)
            if span is not None and completion is not None:
                safely(SPAN_NAME, _mark_bundle, span, completion.bundle)
            return completion

    async def _complete(
        self, request: Mapping[str, Any], fetch: Callable[[], Awaitable[bytes | None]], tokenize: Callable[
            [Mapping[str, Any]], Awaitable[list[int]]]
    ) -> TokenCompletion | None:  # fmt: skip
        try:
            data = await fetch()
            return None if data is None else await self.extract(request, data, tokenize)
        except Exception as exc:
            self._count("errors", {ERROR_TYPE_ATTR: error_type(exc)})
            raise

    async def extract(
        self, request: Mapping[str, Any], data: bytes | str,
        tokenize: Callable[[Mapping[str, Any]], Awaitable[list[int]]] | None,
    ) -> TokenCompletion:  # fmt: skip
        """Run a response body through the extraction chain (``tokenize`` as its fallback)."""
        response = decode_response(data)
        bundle = await self._chain(Exchange(request, response, tokenize, self.allow_tokenize_fallback))
        self._count("sources", {SOURCE_ATTR: bundle.source})
        return TokenCompletion(attach_bundle(response.body, bundle), bundle)

    async def tokenize(self, post: Post, url: str, body: Mapping[str, Any]) -> list[int]:
        """``POST url`` (a server's ``/tokenize``) with ``body`` through ``post``; the prompt ids, timed."""
        started = time.perf_counter()
        data = await post(url, body, "/tokenize")
        instruments = self._instruments.get()
        if instruments is not None:
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            safely("tokens.tokenize_fallback.duration_ms", instruments.tokenize_ms.record, elapsed_ms)
        return decode_tokenize(data)

    def _count(self, which: str, attributes: dict[str, str]) -> None:
        instruments = self._instruments.get()
        if instruments is not None:
            safely(f"tokens counter {which}", getattr(instruments, which).add, 1, attributes)


def _mark_bundle(span: Span, bundle: TokenBundle) -> None:
    span.set_attribute(SOURCE_ATTR, bundle.source)
    span.set_attribute("tokens.exact", bundle.exact)
    span.set_attribute("tokens.prompt_count", len(bundle.prompt_token_ids))
    span.set_attribute("tokens.generation_count", len(bundle.generation_token_ids))
    if bundle.floored_positions:
        span.set_attribute("tokens.floored_count", len(bundle.floored_positions))
