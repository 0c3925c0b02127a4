"""The proxy's upstreams: each a base URL (credentials stripped) and a capturing client, picked by model.

An ``Upstream`` asks for what its server serves: a chat completion whole or as a stream of events
(through ``TokenCaptureTransport``, with inline ids), vLLM's own ``/v1/responses``, the model list.
Its methods raise what the I/O raised (``TokensError``, ``httpx.HTTPError``); the caller answers the
client's view of it. ``Upstreams`` picks one by the request's model and closes them all.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import anyio
import httpx
import msgspec
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Span, TracerProvider

from .._chain import ChainEntry
from .._http import read_body, strip_credentials
from .._transport import TokenCaptureTransport
from ._errors import ProxyError

__all__ = ["Upstream", "Upstreams"]

logger = logging.getLogger("tokens.proxy")
_ENCODE = msgspec.json.Encoder()
_JSON = {"content-type": "application/json"}


class Upstream:
    """One upstream: its base URL (credentials stripped), its capturing client, what it serves."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        transport: httpx.AsyncBaseTransport | None,
        *,
        middleware: Sequence[ChainEntry] | None,
        max_response_bytes: int,
        timeout: httpx.Timeout,
        meter_provider: MeterProvider | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        base, auth = strip_credentials(url.rstrip("/"))
        self.base = base
        self.max_response_bytes = max_response_bytes
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        if transport is None:  # no Nagle delay between a request's headers and its body, nor between events
            transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        capture = TokenCaptureTransport(
            transport,
            request_prompt_and_generation_token_ids=True,
            middleware=middleware,
            max_response_bytes=max_response_bytes,
            meter_provider=meter_provider,
            tracer_provider=tracer_provider,
        )
        self.client = httpx.AsyncClient(transport=capture, auth=auth, headers=headers, timeout=timeout)
        self.serves_responses: bool | None = None  # unknown until asked

    def asks_responses(self, body: Mapping[str, Any], responses_upstream: str) -> bool:
        """Whether to ask vLLM's own ``/v1/responses`` (it has no log probabilities for tool calls)."""
        if responses_upstream == "chat" or self.serves_responses is False:
            return False
        return responses_upstream == "responses" or not (body.get("tools") or body.get("stream"))

    async def models(self) -> bytes:
        """The upstream's ``/models`` answer, as it sent it."""
        response = await self.client.get(self.base + "/models")
        return await read_body(response, "models", 2**20)

    async def chat(self, body: Mapping[str, Any]) -> bytes:
        """A chat completion's answer, whole, as the upstream sent it."""
        response = await self.client.post(self.base + "/chat/completions", content=_ENCODE.encode(body), headers=_JSON)
        return await read_body(response, "answer", self.max_response_bytes)

    async def chat_stream(self, body: Mapping[str, Any], span: Span | None) -> httpx.Response:
        """A chat completion's stream, opened (its events not yet read) inside ``span``."""
        request = self.client.build_request(
            "POST", self.base + "/chat/completions", content=_ENCODE.encode(body), headers=_JSON
        )
        with trace.use_span(span, end_on_exit=False) if span is not None else nullcontext():
            response = await self.client.send(request, stream=True)
        if response.status_code >= 400:
            await read_body(response, "answer", self.max_response_bytes)  # raises the typed error
        return response

    async def responses(self, body: Mapping[str, Any], fall_back: bool) -> bytes | None:
        """vLLM's ``/v1/responses`` answer; None (and remembered) when ``fall_back`` and it is not served."""
        response = await self.client.post(self.base + "/responses", json=body)
        if response.status_code in (404, 405) and fall_back:
            await response.aclose()
            self.serves_responses = False  # remembered: chat completions from now on
            return None
        return await read_body(response, "answer", self.max_response_bytes)


class Upstreams:
    """The upstreams by model name (``None``: the default one)."""

    def __init__(self, upstreams: Mapping[str | None, Upstream]) -> None:
        self.by_model = upstreams

    def first(self) -> Upstream:
        return next(iter(self.by_model.values()))

    def pick(self, body: Mapping[str, Any]) -> Upstream:
        """The upstream that serves the request's model; ``ProxyError`` (404) when none does."""
        model = body.get("model")
        found = self.by_model.get(model if isinstance(model, str) else None) or self.by_model.get(None)
        if found is None:
            served = ", ".join(sorted(str(name) for name in self.by_model))
            raise ProxyError(
                f"model {str(model)[:80]!r} is not served here (models: {served})", param="model", status=404
            )
        return found

    async def aclose(self) -> None:
        """Close every upstream's client, each whatever the others did, shielded and bounded."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            for upstream in self.by_model.values():
                try:
                    await upstream.client.aclose()
                except Exception as exc:  # the others still close
                    logger.warning("tokens.proxy: closing an upstream client failed: %s", type(exc).__name__)
