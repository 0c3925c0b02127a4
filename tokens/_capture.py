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
from ._chain import DEFAULT_CHAIN, ChainEntry, build_chain, check_choice_count
from ._decode import DecodedResponse, decode_tokenize
from ._errors import ConflictingTokenMetadataError, UnsupportedRequestError
from ._exchange import Exchange, TokenizeFn
from ._telemetry import SCOPE, SOURCE_ATTR, TokenInstruments
from ._typed import decode_typed

__all__ = ["Capture", "Post", "attach_bundles", "prepare_request", "server_root", "usage_asked"]

SPAN_NAME = "tokens.chat_completion"

Post = Callable[[str, Mapping[str, Any], str], Awaitable[bytes]]
"""``post(url, body, what)``: the 2xx body of a JSON POST (bounded), or a typed error."""


def server_root(base_url: str) -> str:
    """The server root for ``/tokenize``: ``base_url`` without a trailing slash or ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def prepare_request(body: Mapping[str, Any], *, request_token_ids: bool, streaming: bool = False) -> dict[str, Any]:
    """The request as sent: logprobs forced on, one log probability per token, token ids as tokens;
    for a stream (``streaming``), the final usage chunk too (it carries the bundles).

    Refuses (``UnsupportedRequestError``, before anything is sent) an ``n`` that is not a positive
    int, and ``stream: true`` unless ``streaming``.
    """
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UnsupportedRequestError(f"n={n!r}: the number of choices must be a positive int (or omitted)")
    sent = dict(body)
    if body.get("stream"):
        if not streaming:
            raise UnsupportedRequestError(
                "stream=true: this call returns whole completions; send stream=false (or omit it), or stream "
                "through TokenCaptureTransport"
            )
        sent["stream_options"] = usage_asked(body)
    sent.pop("prompt_logprobs", None)
    sent["logprobs"] = True
    sent["top_logprobs"] = 0
    sent["return_tokens_as_token_ids"] = True
    if request_token_ids:
        sent["return_token_ids"] = True
    return sent


def usage_asked(body: Mapping[str, Any]) -> dict[str, Any]:
    """A streamed request's ``stream_options`` with the final usage chunk asked (the chunk the bundles ride on)."""
    options = body.get("stream_options")
    return {**(options if isinstance(options, dict) else {}), "include_usage": True}


def attach_bundles(body: dict[str, Any], bundles: Sequence[TokenBundle]) -> dict[str, Any]:
    """Place each bundle on its choice's message (the transport fields are already gone)."""
    for choice, bundle in zip(body["choices"], bundles, strict=True):
        message = choice["message"]
        message["prompt_token_ids"] = bundle.prompt_token_ids
        message["generation_token_ids"] = bundle.generation_token_ids
        message["generation_log_probs"] = bundle.generation_log_probs
        if bundle.routed_experts is not None:
            message["routed_experts"] = bundle.routed_experts
            choice.pop("routed_experts", None)
    return body


def _shared_prompt(bundles: Sequence[TokenBundle]) -> None:
    """The choices of one request share its prompt: every choice's prompt ids must equal the first's."""
    first = bundles[0].prompt_token_ids
    for index, bundle in enumerate(bundles[1:], 1):
        prompt = bundle.prompt_token_ids
        if prompt is not first and prompt != first:
            raise ConflictingTokenMetadataError(
                f"choices[{index}] has other prompt ids than choices[0] ({bundle.source!r} source, "
                f"{len(prompt)} vs {len(first)} ids); the choices of one request share one prompt"
            )


def _once(tokenize: TokenizeFn) -> TokenizeFn:
    """``tokenize`` called at most once (one ``/tokenize`` request for a whole group of choices)."""
    done: list[list[int]] = []

    async def call(body: Mapping[str, Any]) -> list[int]:
        if not done:
            done.append(await tokenize(body))
        return done[0]

    return call


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

    _decode: Callable[[bytes | str], DecodedResponse] = staticmethod(decode_typed)
    """How a body is decoded: one typed pass, falling back to ``decode_response`` (tests swap it)."""

    def prepare(self, body: Mapping[str, Any], *, streaming: bool = False) -> dict[str, Any]:
        return prepare_request(body, request_token_ids=self.request_token_ids, streaming=streaming)

    async def complete(
        self, request: Mapping[str, Any], fetch: Callable[[], Awaitable[bytes | None]], tokenize: TokenizeFn
    ) -> TokenCompletion | None:
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
                safely(SPAN_NAME, _mark, span, completion)
            return completion

    async def _complete(
        self, request: Mapping[str, Any], fetch: Callable[[], Awaitable[bytes | None]], tokenize: TokenizeFn
    ) -> TokenCompletion | None:
        try:
            data = await fetch()
            return None if data is None else await self.extract(request, data, tokenize)
        except Exception as exc:
            self._count("errors", {ERROR_TYPE_ATTR: error_type(exc)})
            raise

    async def extract(
        self, request: Mapping[str, Any], data: bytes | str, tokenize: TokenizeFn | None
    ) -> TokenCompletion:
        """Run a response body through the extraction chain once per choice (``tokenize`` as the
        fallback, called at most once for the group)."""
        response = self._decode(data)
        check_choice_count(request, len(response.choices))
        tokenize = None if tokenize is None else _once(tokenize)
        bundles: list[TokenBundle] = []
        for index in range(len(response.choices)):
            exchange = Exchange(request, response, tokenize, self.allow_tokenize_fallback, index=index, group=bundles)
            bundles.append(await self._chain(exchange))
        _shared_prompt(bundles)
        for bundle in bundles:
            self._count("sources", {SOURCE_ATTR: bundle.source})
        return TokenCompletion(attach_bundles(response.body, bundles), tuple(bundles))

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


def _mark(span: Span, completion: TokenCompletion) -> None:
    """The first choice's source and counts, and how many choices there were."""
    bundle = completion.bundle
    span.set_attribute(SOURCE_ATTR, bundle.source)
    span.set_attribute("tokens.exact", bundle.exact)
    span.set_attribute("tokens.prompt_count", len(bundle.prompt_token_ids))
    span.set_attribute("tokens.generation_count", len(bundle.generation_token_ids))
    span.set_attribute("tokens.choices", len(completion.bundles))
    if bundle.floored_positions:
        span.set_attribute("tokens.floored_count", len(bundle.floored_positions))
