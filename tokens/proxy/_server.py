"""Serving the proxy with uvicorn: on the command line, or on a loopback port in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

__all__ = ["ProxyServer", "listen", "serve", "server_config"]


def server_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for the proxy: its lifespan on, idle connections closed after 5 s, header
    blocks capped at 64 KiB, no access log (it would record every rollout's URL)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 2**10,
        timeout_graceful_shutdown=5,
    )


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port), for uvicorn to serve on, whose
    connections send each write at once (``TCP_NODELAY``, which asyncio sets on them); the
    ``OSError`` of an address in use or not of this machine comes here, before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on connections of such a socket, and
    # without it an event written after the headers waited for the client's delayed ACK (40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(server: uvicorn.Server, sock: socket.socket) -> bool:
    """Serve on ``sock`` until the server exits; False when it did not start (uvicorn logged why,
    and exits the process from inside its startup, which is caught here)."""
    try:
        await server.serve(sockets=[sock])
    except SystemExit:
        return False
    finally:
        sock.close()
    return server.started


def bound_url(server: uvicorn.Server, host: str) -> str:
    """The root URL of a started server (its real port when 0 was asked)."""
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://{host}:{port}"


class ProxyServer:
    """The app served on ``host`` (loopback by default) and a free port in a background thread, for
    tests and notebooks: ``with ProxyServer(create_app(...)) as server: server.base_url("rollout-1")``.
    Leaving the block stops the server (its lifespan closes the upstream clients) and the thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 30.0) -> None:
        self._server = uvicorn.Server(server_config(app, host, port))
        self._host = host
        self._port = port
        self._startup_timeout = startup_timeout
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.url = ""
        """The server's root URL, ``http://127.0.0.1:<port>``, once started."""

    def base_url(self, rollout_id: str | None = None) -> str:
        """The OpenAI/Anthropic base URL to give an agent: ``<url>/r/<rollout_id>/v1`` (or ``<url>/v1``)."""
        return f"{self.url}/r/{rollout_id}/v1" if rollout_id is not None else f"{self.url}/v1"

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(serve(self._server, sock))
        except BaseException as exc:  # reported to the starting thread
            self._failure = exc

    def __enter__(self) -> ProxyServer:
        try:
            sock = listen(self._host, self._port)
        except OSError as exc:
            raise RuntimeError(
                f"ProxyServer: cannot listen on {self._host}:{self._port}: {exc.strerror or exc}; pass another "
                "port (0: any free one)"
            ) from exc
        self._thread = threading.Thread(target=self._run, args=(sock,), name="tokens-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._stop()
                why = "" if self._failure is None else f" ({type(self._failure).__name__}: {self._failure})"
                raise RuntimeError(
                    f"ProxyServer: the proxy did not start on {self._host} within {self._startup_timeout:g} s{why}; "
                    "see the log of uvicorn and of the app's lifespan"
                )
            time.sleep(0.01)
        self.url = bound_url(self._server, self._host)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._stop()

    def _stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout=5)
