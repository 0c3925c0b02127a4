"""The routes real clients call beside a dialect's model call, each answered in the dialect of its path.

- ``GET`` and ``HEAD`` of a base URL (``/``, ``/v1``, ``/r/<rollout>``, ``/r/<rollout>/v1``): a
  client's probe (Claude Code's ``HEAD``), answered 200.
- ``GET /v1/models/{id}``: the upstream's model of that id, in OpenAI's shape (Anthropic's to a client
  that sends ``anthropic-version``); a 404 in that dialect for a model the upstream does not list.
- ``GET /v1/responses/{id}``: a Responses answer this proxy gave and keeps (its ``ResponseHistory``),
  without its bundle (the record has it).
- ``POST /v1/messages/count_tokens`` and ``POST /v1/responses/input_tokens``: the prompt's token count,
  exact: the request converted as its model call would be, counted by the upstream's ``/tokenize``.
- ``POST /v1/completions``: passed on with ids and log probabilities asked, the bundle on each choice
  (a stream's on its final chunk, as a chat stream's), recorded as a token-in call.
- Anything else: a 404 in the dialect of its path (Anthropic's under ``/v1/messages`` or with
  ``anthropic-version``; OpenAI's otherwise).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from _shared_telemetry import error_type

from .._bundle import TokenCompletion
from .._capture import usage_asked
from .._errors import TokensError
from .._http import read_body
from .._stream import CapturedStream, open_stream
from .._token_in import extract_token_in
from ._answers import Relayed, relay
from ._dialects import CHAT, Dialect
from ._errors import ProxyError, RequestRejectedError, upstream_error
from ._intake import Intake, call_of, read_json
from ._telemetry import Report
from ._upstream import Upstream, Upstreams

__all__ = ["Side"]

logger = logging.getLogger("tokens.proxy")
_DECODE = msgspec.json.Decoder(dict[str, Any])
_COUNTS = ("messages/count_tokens", "responses/input_tokens")
_TOKENIZED = ("tools", "chat_template_kwargs")
"""What ``/tokenize`` takes of a chat request besides its model and messages."""


def _root(upstream: Upstream) -> str:
    """The upstream's server root (``/tokenize`` lives there): its base URL without ``/v1``."""
    return upstream.base.removesuffix("/v1")


class Side:
    """The side routes of one proxy: its upstreams, its intake (body limits, records) and its dialects."""

    def __init__(self, upstreams: Upstreams, intake: Intake, dialects: Mapping[str, Dialect]) -> None:
        self.upstreams = upstreams
        self.intake = intake
        self.dialects = dialects

    def dialect_of(self, request: Request, path: str) -> Dialect:
        """The dialect a path answers in: its own, else Anthropic's for a client that says it speaks it."""
        head = path.split("/", 1)[0]
        if head in ("messages", "responses"):
            return self.dialects[head]
        if head == "chat" or "anthropic-version" not in request.headers:
            return CHAT
        return self.dialects["messages"]

    async def answer(self, request: Request, path: str, place: AsyncExitStack) -> Response:
        """The answer to a request that is no dialect's model call (``path``: under ``/v1/``). The
        rollout it names is checked first (its token, when the proxy holds a rollout key); a route
        that asks an upstream takes its place in ``place`` (which the caller holds to the last byte)."""
        dialect = self.dialect_of(request, path)
        try:
            await self.intake.enter(request, place if _asks_upstream(request.method, path) else None)
            return await self._route(request, path, dialect)
        except Exception as exc:
            error = exc if isinstance(exc, ProxyError) else None
            if error is None:  # a defect of ours: logged, and still an answer the client's SDK parses
                logger.error("tokens.proxy: unexpected %s serving %s /v1/%s", error_type(exc), request.method,
                             path[:80], exc_info=exc)  # fmt: skip
                error = ProxyError(f"the proxy failed unexpectedly ({type(exc).__name__}); see its log")
            if request.method == "HEAD":
                return Response(status_code=error.status, headers=error.headers)
            return JSONResponse(dialect.error_body(error), status_code=error.status, headers=error.headers)

    async def _route(self, request: Request, path: str, dialect: Dialect) -> Response:
        method = request.method
        if method == "HEAD" and (path in ("", "models") or path in self.dialects):
            return Response(status_code=200)
        if method == "GET" and path == "":
            return JSONResponse({"object": "tokens.proxy", "status": "ok"})
        if method == "GET" and path == "models":
            return Response(await self._upstream_models(), media_type="application/json")
        if method == "GET" and path.startswith("models/"):
            return await self._model(path.removeprefix("models/"), dialect)
        if method == "GET" and path.startswith("responses/"):
            return JSONResponse(await dialect.kept(path.removeprefix("responses/")))
        if method == "POST" and path in _COUNTS:
            count = await self._count(request, dialect)
            if path == "messages/count_tokens":
                return JSONResponse({"input_tokens": count})
            return JSONResponse({"object": "response.input_tokens", "input_tokens": count})
        if method == "POST" and path == "completions":
            return await self._completions(request)
        raise ProxyError(
            f"{method} /v1/{path[:80]} is not served: POST /v1/chat/completions, /v1/responses, /v1/messages "
            "(and /v1/messages/count_tokens, /v1/responses/input_tokens, /v1/completions), GET /v1/models",
            status=404,
        )

    async def _upstream_models(self) -> bytes:
        try:
            return await self.upstreams.models()
        except (TokensError, httpx.HTTPError) as exc:
            raise upstream_error(exc) from None

    async def _model(self, model_id: str, dialect: Dialect) -> Response:
        listed = _DECODE.decode(await self._upstream_models()).get("data")
        for model in listed if isinstance(listed, list) else ():
            if isinstance(model, dict) and model.get("id") == model_id:
                if dialect is CHAT:
                    return JSONResponse(model)
                created = model["created"] if type(model.get("created")) is int else 0
                return JSONResponse(
                    {
                        "type": "model",
                        "id": model_id,
                        "display_name": model_id,
                        "created_at": _rfc3339(created),
                        "lifecycle": "active",
                    }
                )
        raise ProxyError(f"model {model_id[:80]!r} is not served here", param="model", status=404)

    async def _count(self, request: Request, dialect: Dialect) -> int:
        """The prompt's tokens as the upstream's tokenizer counts the request's model call."""
        body = await read_json(request, self.intake.max_request_bytes, self.intake.client_timeout)
        if dialect.name == "messages" and "max_tokens" not in body:
            body = {**body, "max_tokens": 1}  # counting takes no max_tokens; the conversion needs one
        history, _ = await dialect.history(body)
        chat = dialect.to_chat({**body, "stream": False}, history)
        asked = {"model": chat.get("model"), "messages": chat["messages"], "add_generation_prompt": True}
        asked.update({name: chat[name] for name in _TOKENIZED if name in chat})

        async def tokenize(upstream: Upstream) -> dict[str, Any]:
            response = await upstream.client.post(_root(upstream) + "/tokenize", json=asked)
            return _DECODE.decode(await read_body(response, "tokenize", upstream.max_response_bytes))

        affinity = call_of(request).affinity
        try:  # the replica the call itself would go to (its tokenizer is the same on every one)
            counted, _ = await self.upstreams.pick(body).ask(affinity, tokenize)
        except (TokensError, httpx.HTTPError, msgspec.MsgspecError) as exc:
            raise upstream_error(exc) from None
        count = counted.get("count")
        if type(count) is not int:
            raise upstream_error(ValueError("the upstream's /tokenize answer has no count"))
        return count

    async def _completions(self, request: Request) -> Response:
        """A legacy completion passed on with its ids and log probabilities asked, the bundle on each
        choice (``extract_token_in``), recorded as a token-in call; a stream event by event, the
        bundles on its final chunk (``token_bundles``), as a chat stream's."""
        body = await read_json(request, self.intake.max_request_bytes, self.intake.client_timeout)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestRejectedError(f"stream: must be true or false, not {stream!r:.40}", param="stream")
        call = call_of(request)
        custody = self.intake.recorder.custody(call.coordinates)
        n = body.get("n")
        if custody.recorded and n is not None and n != 1:
            raise RequestRejectedError(f"n={n!r} with a rollout id: a record holds one choice; send n=1", param="n")
        logprobs = body.get("logprobs")
        sent = {**body, "return_token_ids": True, "logprobs": logprobs if isinstance(logprobs, int) else 0}
        if stream:
            sent["stream_options"] = usage_asked(body)

        async def finish(data: bytes) -> TokenCompletion:
            return extract_token_in(sent, data)

        async def complete(upstream: Upstream) -> tuple[httpx.Response, CapturedStream | bytes]:
            response = await upstream.ask("/completions", sent)
            if stream:
                return response, await open_stream(response, finish, upstream.max_response_bytes, completions=True)
            return response, await read_body(response, "answer", upstream.max_response_bytes)

        async with custody:
            try:  # on the rollout's replica, failing over as a model call does
                (response, answer), replica = await self.upstreams.pick(body).ask(call.affinity, complete)
                if custody.recorded:
                    custody.served_by = replica.name
                if isinstance(answer, CapturedStream):  # the custody's end comes with the stream's events
                    to = Relayed(custody, Report("completions", stream=True), call.headers, CHAT)
                    return relay(response, answer, custody.write_token_in, to, self.intake.client_timeout)
                completion = extract_token_in(sent, answer)
            except (TokensError, httpx.HTTPError) as exc:
                raise upstream_error(exc) from None
            await custody.write_token_in(completion)
        return JSONResponse(completion.response, headers=call.headers)


def _asks_upstream(method: str, path: str) -> bool:
    """Whether a side route asks an upstream (and so takes a place): the model list, a model by id,
    the token counts and legacy completions."""
    if method == "GET":
        return path == "models" or path.startswith("models/")
    return method == "POST" and (path == "completions" or path in _COUNTS)


def _rfc3339(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
