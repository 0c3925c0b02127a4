"""python -m tokens.proxy --upstream URL [--upstream URL ...] [--store URL] [--host 127.0.0.1] [--port PORT]:
serve the capture proxy. Its root URL is printed on one line once it listens; agents use
<url>/r/<rollout-id>/v1 as their base URL. Several --upstream are one upstream's replicas (a rollout's
calls on one of them, failing over). Needs the 'proxy' extra: pip install 'llm-sandbox-middleware[proxy]'."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Sequence

import uvicorn

from .._http import DEFAULT_MAX_RESPONSE_BYTES
from ..records import RecordsError, RecordStore, open_store
from ._app import DEFAULT_MAX_REQUEST_BYTES, create_app
from ._credentials import ROLLOUT_KEY_ENV
from ._history import (
    DEFAULT_PREVIOUS_BYTES,
    DEFAULT_PREVIOUS_RESPONSES,
    DEFAULT_STORE_BYTES,
    DEFAULT_STORE_RESPONSES,
    DEFAULT_TTL_S,
)
from ._limits import DEFAULT_MAX_QUEUED, DEFAULT_MAX_REQUESTS, DEFAULT_MAX_ROLLOUT_REQUESTS, DEFAULT_QUEUE_TIMEOUT
from ._server import bound_url, listen, serve, server_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokens.proxy", description=__doc__)
    parser.add_argument(
        "--upstream",
        required=True,
        action="append",
        help="the OpenAI-compatible base URL, e.g. http://host:8000/v1; again for each replica of it (a rollout's "
        "calls go to one replica, by X-Session-Id or the rollout id; the next one when it fails)",
    )
    parser.add_argument(
        "--store",
        help="where records go, e.g. sqlite:///records.db or postgresql://... (tokens.records.open_store); "
        "previous_response_id state is kept there too, so proxies over one store serve one conversation",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=port, default=0, help="the port (default: 0, any free one)")
    parser.add_argument(
        "--upstream-api-key-env",
        metavar="NAME",
        help="the environment variable holding the upstream's API key (never on the command line)",
    )
    parser.add_argument(
        "--responses-upstream",
        choices=("auto", "responses", "chat"),
        default="auto",
        help="how Responses API requests are served: auto (default) asks the upstream's /v1/responses for "
        "those without tools and not streamed and converts the rest to chat completions; chat always "
        "converts; responses always asks /v1/responses",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="BYTES",
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="bounds each upstream read, a stream's silence between events too (default 600)",
    )
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body slower than this gets 408; a client not taking an event within it is dropped (default 60)",
    )
    parser.add_argument(
        "--previous-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        metavar="SECONDS",
        help=f"with --store, how long a response is kept there for previous_response_id (default {DEFAULT_TTL_S:g})",
    )
    parser.add_argument(
        "--previous-responses",
        type=int,
        metavar="N",
        help="turns kept for previous_response_id: in memory (default "
        f"{DEFAULT_PREVIOUS_RESPONSES}), or with --store in the store, for every proxy over it together (default "
        f"{DEFAULT_STORE_RESPONSES}); 0: none",
    )
    parser.add_argument(
        "--previous-bytes",
        type=int,
        metavar="BYTES",
        help=f"those turns' size together at most (default {DEFAULT_PREVIOUS_BYTES} in memory, "
        f"{DEFAULT_STORE_BYTES} in a store)",
    )
    parser.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        metavar="BYTES",
        help=f"an upstream answer (a stream in total) over this is a 502 (default {DEFAULT_MAX_RESPONSE_BYTES})",
    )
    parser.add_argument(
        "--max-requests",
        type=int,
        default=DEFAULT_MAX_REQUESTS,
        metavar="N",
        help=f"requests served at once (default {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--max-rollout-requests",
        type=int,
        default=DEFAULT_MAX_ROLLOUT_REQUESTS,
        metavar="N",
        help=f"requests of one rollout served at once (default {DEFAULT_MAX_ROLLOUT_REQUESTS})",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        metavar="N",
        help=f"requests waiting for a place; more get 429 (default {DEFAULT_MAX_QUEUED})",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=DEFAULT_QUEUE_TIMEOUT,
        metavar="SECONDS",
        help=f"a request waiting longer for a place gets 429 (default {DEFAULT_QUEUE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--rollout-key-env",
        metavar="NAME",
        help=f"the environment variable holding the rollout key: a rollout's requests must then carry its token "
        f"(tokens.proxy.mint_rollout_token); default {ROLLOUT_KEY_ENV}, used when set",
    )
    return parser


def port(text: str) -> int:
    """A TCP port (argparse names this function in its message for what is not a number)."""
    number = int(text)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a TCP port (0 to 65535; 0: any free one)")
    return number


async def _serve(server: uvicorn.Server, sock: socket.socket, host: str) -> bool:
    task = asyncio.create_task(serve(server, sock))
    while not server.started:
        if task.done():
            return await task  # False: uvicorn logged why (the app's lifespan failed)
        await asyncio.sleep(0.01)
    print(bound_url(server, host), flush=True)
    return await task


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 after serving (until SIGINT), 2 for unusable options, 1 when it cannot
    listen on ``--host``/``--port`` or does not start."""
    args = _parser().parse_args(argv)
    key = None
    if args.upstream_api_key_env:
        key = os.environ.get(args.upstream_api_key_env)
        if not key:
            print(f"tokens.proxy: the environment variable {args.upstream_api_key_env} is not set", file=sys.stderr)
            return 2
    rollout_key = os.environ.get(args.rollout_key_env or ROLLOUT_KEY_ENV) or None
    if args.rollout_key_env and rollout_key is None:
        print(f"tokens.proxy: the environment variable {args.rollout_key_env} is not set", file=sys.stderr)
        return 2
    store = None
    if args.store:
        try:
            store = open_store(args.store)
        except RecordsError as exc:
            print(f"tokens.proxy: --store: {exc}", file=sys.stderr)
            return 2
    try:
        return _run(args, store, key, rollout_key)
    finally:
        if store is not None:
            asyncio.run(store.close())


def _run(args: argparse.Namespace, store: RecordStore | None, key: str | None, rollout_key: str | None) -> int:
    try:
        upstream = args.upstream[0] if len(args.upstream) == 1 else args.upstream
        app = create_app(upstream, store=store, upstream_api_key=key, responses_upstream=args.responses_upstream,
                         max_request_bytes=args.max_request_bytes, upstream_timeout=args.upstream_timeout,
                         client_timeout=args.client_timeout, previous_ttl=args.previous_ttl,
                         previous_responses=args.previous_responses,
                         previous_bytes=args.previous_bytes, max_response_bytes=args.max_response_bytes,
                         max_requests=args.max_requests, max_rollout_requests=args.max_rollout_requests,
                         max_queued=args.max_queued, queue_timeout=args.queue_timeout,
                         rollout_key=rollout_key)  # fmt: skip
    except ValueError as exc:
        print(f"tokens.proxy: {exc}", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        print(
            f"tokens.proxy: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; pick another --port "
            "(0: any free one) or --host",
            file=sys.stderr,
        )
        return 1
    server = uvicorn.Server(server_config(app, args.host, args.port))
    started = True
    with contextlib.suppress(KeyboardInterrupt):
        started = asyncio.run(_serve(server, sock, args.host))
    if not started:
        print("tokens.proxy: the proxy did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
