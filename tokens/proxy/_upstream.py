"""The proxy's upstreams: each a base URL (credentials stripped) and a capturing client, picked by model.

An ``Upstream`` asks for what its server serves: a chat completion whole or as a stream of events
(through ``TokenCaptureTransport``, with inline ids), vLLM's own ``/v1/responses`` (its bundle
through the capture chain), the model list; its methods raise what the I/O raised (``TokensError``,
``httpx.HTTPError``). ``Upstreams.send`` sends one turn to the upstream of its model, by the API
it asks (vLLM's own where it is served, else chat completions), and gives back the ``Reply``; a
model served by several replicas is asked on the replica of the call's affinity, failing over to
the next (``_affinity``), and the call's record names the replica that answered. A failure is
raised as the client's view of it (``upstream_error``), told in the turn's report. ``Upstreams``
closes them all.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import anyio
import httpx
import msgspec
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from .._bundle import TokenBundle
from .._chain import DEFAULT_CHAIN, ChainEntry, build_chain
from .._errors import TokensError
from .._exchange import Exchange
from .._http import read_body, strip_credentials
from .._transport import BODY_EXTENSION, CHAT_PATH, TokenCaptureTransport
from .._vllm_responses import decode_responses
from ._affinity import Replicas
from ._errors import ProxyError, upstream_error
from ._intake import Turn

__all__ = ["Reply", "Upstream", "Upstreams"]

logger = logging.getLogger("tokens.proxy")
_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(dict[str, Any])
_JSON = {"content-type": "application/json"}


class Reply(NamedTuple):
    """The upstream's answer to a turn: ``chat``, the chat completion it was asked as (what a record
    keeps), and either its ``answer`` whole (a chat completion with inline ids, or vLLM's own answer
    with its ``bundle``) or its chat ``stream`` opened, the events not read yet."""

    chat: dict[str, Any]
    answer: dict[str, Any] | None = None
    bundle: TokenBundle | None = None
    stream: httpx.Response | None = None


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
        self.chain = build_chain(DEFAULT_CHAIN if middleware is None else middleware)
        self.serves_responses: bool | None = None  # unknown until asked

    async def models(self) -> bytes:
        """The upstream's ``/models`` answer, as it sent it."""
        response = await self.client.get(self.base + "/models")
        return await read_body(response, "models", 2**20)

    async def ask(self, path: str, body: Mapping[str, Any]) -> httpx.Response:
        """``body`` posted to ``path`` (under the base URL): the answer with its head read, its body not yet.
        A chat completion goes to the capture transport as the dict it is, encoded once, there."""
        if path == CHAT_PATH:
            request = self.client.build_request(
                "POST", self.base + path, content=b"", headers=_JSON, extensions={BODY_EXTENSION: body}
            )
        else:
            request = self.client.build_request("POST", self.base + path, content=_ENCODE.encode(body), headers=_JSON)
        return await self.client.send(request, stream=True)


class Upstreams:
    """The upstreams by model name (``None``: the default one), each model's replicas; ``fall_back``:
    a Responses request whose upstream has no ``/v1/responses`` is asked as a chat completion
    (``responses_upstream="auto"``)."""

    def __init__(self, upstreams: Mapping[str | None, Replicas[Upstream]], fall_back: bool) -> None:
        self.by_model = upstreams
        self.fall_back = fall_back

    async def send(self, turn: Turn) -> Reply:
        """The turn sent to a replica of its model's upstream (the first of its affinity's order that
        answers; the next one where a replica fails over) and that replica's reply, named in the
        call's record."""
        try:
            reply, replica = await self.pick(turn.body).ask(turn.call.affinity, lambda up: self._ask(up, turn))
        except (TokensError, httpx.HTTPError) as exc:
            turn.report.cause = exc
            raise upstream_error(exc) from None
        if turn.custody.recorded:
            turn.custody.served_by = replica.name
        return reply

    async def _ask(self, upstream: Upstream, turn: Turn) -> Reply:
        """The turn asked of one upstream, by the API it asks (vLLM's own, or chat completions, when
        the upstream answers 404 to it and ``fall_back``); what the I/O raised, raised."""
        report = turn.report
        native = turn.native if upstream.serves_responses is not False else None
        chat = turn.chat
        if native is not None:
            report.upstream_api = "responses"
            response = await upstream.ask("/responses", native)
            if response.status_code in (404, 405) and self.fall_back:
                await response.aclose()
                native = None
                upstream.serves_responses = False  # remembered: chat completions from now on
        if native is None:
            chat = turn.dialect.to_chat(turn.body, turn.history) if chat is None else chat
            report.upstream_api = "chat"
            response = await upstream.ask(CHAT_PATH, chat)
            if turn.stream and response.status_code < 400:
                return Reply(chat, stream=response)
        data = await read_body(response, "answer", upstream.max_response_bytes)  # a failure raises, typed
        if native is None:
            return Reply(chat or {}, _DECODE.decode(data))
        decoded = decode_responses(data)
        bundle = await upstream.chain(Exchange(native, decoded))
        upstream.serves_responses = True
        return Reply(chat or {}, decoded.answer, bundle)

    async def models(self) -> bytes:
        """The ``/models`` answer of the first upstream, from the first of its replicas that answers."""
        data, _ = await next(iter(self.by_model.values())).ask("", Upstream.models)
        return data

    def pick(self, body: Mapping[str, Any]) -> Replicas[Upstream]:
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
            for upstream in (replica.upstream for model in self.by_model.values() for replica in model.replicas):
                try:
                    await upstream.client.aclose()
                except Exception as exc:  # the others still close
                    logger.warning("tokens.proxy: closing an upstream client failed: %s", type(exc).__name__)
