"""The capture proxy's ASGI app: three dialects in, exact ids captured, answers in the client's dialect.

A request is read with a size limit and a deadline, converted to what the upstream serves with
exact ids (chat completions with inline ids through ``TokenCaptureTransport``, or vLLM's own
``/v1/responses`` with raw message tokens), and answered in its own dialect. A stream is passed on
event by event as the upstream produces it; its bundle is complete at its end. Every failure is a
``ProxyError`` answered in the client's dialect (a JSON error before a stream starts, an error
event inside one), and never names the upstream.

This module is the composition: the routes and the app's lifetime, and one request's way through
the stages, each a module the request enters once: ``_telemetry`` opens the call's ``Report``
(told once, after the answer's last byte), ``_intake`` reads and checks it into a ``Turn``,
``_upstream`` sends it and receives the ``Reply``, then ``_answers`` records it and answers in the
client's dialect, whole or event by event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal

import httpx
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from _shared_telemetry import error_type

from .._chain import ChainEntry
from .._http import DEFAULT_MAX_RESPONSE_BYTES, check_limit, strip_credentials
from ._affinity import Replicas
from ._answers import serve
from ._credentials import RolloutKey
from ._dialects import Dialect, dialects
from ._errors import ProxyError
from ._history import DEFAULT_TTL_S, ResponseHistory, history_for
from ._intake import Intake
from ._limits import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_ROLLOUT_REQUESTS,
    DEFAULT_QUEUE_TIMEOUT,
    Admission,
)
from ._records import Recorder
from ._side import Side
from ._sink import TokenSink
from ._telemetry import ProxyTelemetry
from ._upstream import Upstream, Upstreams

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "create_app"]

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
"""32 MiB: a 128K-token conversation as JSON is a few MiB; room for images as data URLs."""

logger = logging.getLogger("tokens.proxy")


class _App:
    def __init__(
        self,
        upstreams: Upstreams,
        intake: Intake,
        *,
        client_timeout: float,
        previous: ResponseHistory,
        meter_provider: MeterProvider | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        self.upstreams = upstreams
        self.intake = intake
        self.client_timeout = client_timeout
        self.dialects = dialects(previous)
        self.side = Side(upstreams, intake, self.dialects)
        self.telemetry = ProxyTelemetry(meter_provider, tracer_provider)

    async def aclose(self) -> None:
        await self.upstreams.aclose()

    # -- the request --------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The routes' endpoint (ASGI, so that a call's telemetry lasts to its answer's last byte)."""
        await self.endpoint(Request(scope, receive), send)

    async def endpoint(self, request: Request, send: Send) -> None:
        """The route: a dialect's POST is served as a model call; the rest are the side routes
        (``_side``: probes, models, kept answers, token counts, legacy completions, 404s)."""
        path = request.path_params.get("path", "")
        dialect = self.dialects.get(path)
        if dialect is not None and request.method == "POST":
            return await self.serve(dialect, request, send)
        async with AsyncExitStack() as place:  # a side route's place (where it asks an upstream), to its last byte
            response = await self.side.answer(request, path, place)
            await response(request.scope, request.receive, send)

    async def serve(self, dialect: Dialect, request: Request, send: Send) -> None:
        """A request's one way through the stages, told of once (to its answer's last byte): its rollout
        checked and a place taken for it (held in ``place`` to its answer's last byte), read in, sent
        upstream with its call in custody, answered whole or streamed; any failure answered in the
        client's dialect."""
        with self.telemetry.report(dialect.name) as report:
            async with AsyncExitStack() as place:  # the request's place, held to its answer's last byte
                response: Response
                try:
                    turn = await self.intake.turn_of(request, dialect, report, place)
                    async with turn.custody:  # begun before anything is sent; a stream's own end comes with its events
                        reply = await self.upstreams.send(turn)
                        response = await serve(turn, reply, self.client_timeout)
                except Exception as exc:
                    failure = exc if isinstance(exc, ProxyError) else None
                    if failure is None:  # a defect of ours: logged, and still an answer the client's SDK parses
                        logger.error(
                            "tokens.proxy: unexpected %s serving a %s request",
                            error_type(exc),
                            dialect.name,
                            exc_info=exc,
                        )
                        failure = ProxyError(f"the proxy failed unexpectedly ({type(exc).__name__}); see its log")
                    report.error = failure
                    response = JSONResponse(
                        dialect.error_body(failure), status_code=failure.status, headers=failure.headers
                    )
                await response(request.scope, request.receive, send)


def create_app(
    upstream_url: str | Sequence[str] | Mapping[str | None, str | Sequence[str]],
    *,
    store: TokenSink | None = None,
    upstream_api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    responses_upstream: Literal["auto", "responses", "chat"] = "auto",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    upstream_timeout: float = 600.0,
    connect_timeout: float = 10.0,
    client_timeout: float = 60.0,
    previous_responses: int | None = None,
    previous_bytes: int | None = None,
    previous_ttl: float = DEFAULT_TTL_S,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_rollout_requests: int = DEFAULT_MAX_ROLLOUT_REQUESTS,
    max_queued: int = DEFAULT_MAX_QUEUED,
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
    rollout_key: str | bytes | None = None,
    middleware: Sequence[ChainEntry] | None = None,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Starlette:
    """The capture proxy as an ASGI app (Starlette) in front of ``upstream_url``.

    ``upstream_url`` is an OpenAI-compatible base (``http://host:8000/v1``; ``user:password@`` in it
    becomes basic auth, ``upstream_api_key`` a bearer token), or a mapping of model names to bases
    (``None`` as the default); a list of bases in either place is one upstream's replicas: a call is
    asked on the replica its affinity picks (the ``X-Session-Id`` header, else the rollout id, by
    rendezvous hashing), failing over to the next when one refuses the connection or answers 5xx,
    and its record names the replica in ``served_by``. Clients call ``POST /v1/chat/completions``, ``/v1/responses`` or
    ``/v1/messages``, or the same under ``/r/<rollout-id>/v1/...``; their own credentials are never
    forwarded. ``transport`` does the upstream I/O (default: a plain HTTP transport; e.g.
    ``httpx.MockTransport(FakeVLLM())`` in tests). ``responses_upstream`` picks how Responses
    requests are served: ``"auto"`` asks vLLM's ``/v1/responses`` for those without tools and not
    streamed (falling back to chat completions for good when the upstream answers 404), ``"chat"``
    always converts, ``"responses"`` always asks ``/v1/responses``.

    Limits: request bodies over ``max_request_bytes`` get 413, bodies slower than ``client_timeout``
    408, upstream answers over ``max_response_bytes`` 502; ``upstream_timeout`` bounds each upstream
    read (a stream's silence between events too), ``connect_timeout`` its connection, and a client
    that does not take an event within ``client_timeout`` is dropped. For ``previous_response_id``,
    the last ``previous_responses`` turns (0: none) of at most ``previous_bytes`` together are kept
    in memory (default 1,024 turns, 256 MiB), each turn its own input and output only (and the
    answer it was, for ``GET /v1/responses/{id}``); with a ``store`` that keeps them (a
    ``RecordStore``) they are kept there instead, each for ``previous_ttl`` seconds, so that every
    proxy over the same store continues every conversation, and the bounds are the store's, for
    every proxy over it together (default a million turns, 16 GiB; the oldest evicted first).

    At most ``max_requests`` requests are served at once, ``max_rollout_requests`` of one rollout;
    up to ``max_queued`` more wait for a place (``queue_timeout`` seconds at most), the rest get 429
    with ``Retry-After``. With ``rollout_key`` (at least 16 bytes), a request that names a rollout
    must carry that rollout's token (``mint_rollout_token(rollout_key, rollout_id)``) in its path,
    ``/r/<rollout-id>/t/<token>/v1/...``, or in ``X-Rollout-Token``: 401 without it, 403 for another.
    The side routes (probes, models, kept answers, token counts, legacy completions) are checked
    the same way where they name a rollout, and take a place where they ask an upstream.
    """
    max_response_bytes = check_limit("create_app", max_response_bytes)
    for name, value in (
        ("max_request_bytes", max_request_bytes),
        ("previous_responses", 1 if previous_responses is None else previous_responses + 1),
        ("previous_bytes", 1 if previous_bytes is None else previous_bytes),
        ("max_requests", max_requests),
        ("max_rollout_requests", max_rollout_requests),
        ("max_queued", max_queued + 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"create_app: {name} must be a positive int, not {value!r}")
    for name, seconds in (
        ("upstream_timeout", upstream_timeout),
        ("connect_timeout", connect_timeout),
        ("client_timeout", client_timeout),
        ("previous_ttl", previous_ttl),
        ("queue_timeout", queue_timeout),
    ):
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < float("inf"):
            raise ValueError(f"create_app: {name} must be a positive number of seconds, not {seconds!r}")
    if responses_upstream not in ("auto", "responses", "chat"):
        raise ValueError(
            f"create_app: responses_upstream must be 'auto', 'responses' or 'chat', not {responses_upstream!r}"
        )
    given = upstream_url if isinstance(upstream_url, Mapping) else {None: upstream_url}
    urls = {model: [bases] if isinstance(bases, str) else list(bases) for model, bases in given.items()}
    for model, bases in urls.items():
        where = "upstream_url" if model is None else f"upstream_url[{model!r}]"
        for url in bases or [""]:
            parsed = httpx.URL(url) if isinstance(url, str) and url else None
            if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
                raise ValueError(f"create_app: {where} must be an http(s) URL with a host, e.g. http://host:8000/v1")
        if len({strip_credentials(url.rstrip("/"))[0] for url in bases}) != len(bases):
            raise ValueError(f"create_app: {where} names one replica twice; give each replica's base URL once")
    timeout = httpx.Timeout(upstream_timeout, connect=connect_timeout)
    replicas = {
        model: Replicas(
            [
                Upstream(
                    url,
                    upstream_api_key,
                    transport,
                    middleware=middleware,
                    max_response_bytes=max_response_bytes,
                    timeout=timeout,
                    meter_provider=meter_provider,
                    tracer_provider=tracer_provider,
                )
                for url in bases
            ]
        )
        for model, bases in urls.items()
    }
    if not replicas:
        raise ValueError("create_app: upstream_url names no upstream")
    key = None if rollout_key is None else RolloutKey(rollout_key)
    admission = Admission(max_requests, max_rollout_requests, max_queued, queue_timeout)
    intake = Intake(max_request_bytes, client_timeout, responses_upstream, Recorder(store), admission, key)
    proxy = _App(
        Upstreams(replicas, fall_back=responses_upstream == "auto"),
        intake,
        client_timeout=client_timeout,
        previous=history_for(store, previous_responses, previous_bytes, previous_ttl),
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.aclose()

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]
    probed = ["/", "/v1"]  # base URLs clients probe (HEAD, GET), also under a rollout (and its token)
    for rollout in ("/r/{rollout}", "/r/{rollout}/t/{token}"):
        probed += [rollout, rollout + "/", rollout + "/v1"]
    routes = [
        Route("/v1/{path:path}", proxy, methods=methods),
        Route("/r/{rollout}/v1/{path:path}", proxy, methods=methods),
        Route("/r/{rollout}/t/{token}/v1/{path:path}", proxy, methods=methods),
        *(Route(base, proxy, methods=methods) for base in probed),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    return app
