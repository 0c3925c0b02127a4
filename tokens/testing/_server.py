"""A ``FakeVLLM`` served over real HTTP (the standard library's threaded server): for programs that
cannot take an httpx transport, and for examples run on a machine without a GPU.

Bodies are the fake's own; a stream (``text/event-stream``) leaves one event per HTTP chunk, each
written as soon as it is due (``stream_delay_s`` apart), over HTTP/1.1 keep-alive connections.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import socketserver
import sys
import threading
from types import TracebackType
from typing import Any

import httpx

from ._fake_vllm import FakeVLLM, _error

__all__ = ["FakeVLLMServer", "bind"]

MAX_REQUEST_BYTES = 32 * 2**20
IDLE_TIMEOUT_S = 30.0
"""An idle keep-alive connection (or a request body that stops arriving) is closed after this long."""
_HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class _HTTPServer(http.server.ThreadingHTTPServer):
    """One thread per connection; ``server_close`` ends the open connections and joins their threads."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], fake: FakeVLLM, stream_delay_s: float, log: bool) -> None:
        self.fake = fake
        self.stream_delay_s = stream_delay_s
        self.log = log
        self.lock = threading.Lock()  # the fake is not thread-safe: one request at a time inside it
        self.connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self.closing = threading.Event()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        self.closing.set()
        socketserver.TCPServer.server_close(self)  # the listening socket first
        with self._connections_lock:
            open_connections = list(self.connections)
        for connection in open_connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        super().server_close()  # joins the connections' threads

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset or dropped its connection has gone away, as clients do (a proxy closing its
        keep-alive connections): nothing to report. Anything else is printed, as the standard library does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


def bind(host: str, port: int, fake: FakeVLLM, *, stream_delay_s: float = 0.0, log: bool = False) -> _HTTPServer:
    """A server for ``fake`` listening on ``host``:``port`` (0: any free one); the ``OSError`` of an
    address in use or not of this machine comes here."""
    kind = _HTTPServer6 if ":" in host else _HTTPServer
    return kind((host, port), fake, stream_delay_s, log)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S

    def do_GET(self) -> None:
        self._answer()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def version_string(self) -> str:
        return "fake-vllm"

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.log:
            sys.stderr.write(f"fake vLLM: {self.address_string()} {format % args}\n")

    def _answer(self) -> None:
        length = self.headers.get("content-length", "0" if self.command in {"GET", "DELETE"} else "")
        if "transfer-encoding" in self.headers or not length.isdigit():
            self._send(_error(411, "Send the body with a Content-Length", "LengthRequiredError"), close=True)
            return
        if int(length) > MAX_REQUEST_BYTES:
            self._send(_error(413, f"The body is over {MAX_REQUEST_BYTES} bytes", "RequestTooLargeError"), close=True)
            return
        body = self.rfile.read(int(length))
        try:
            request = httpx.Request(
                self.command, f"http://fake-vllm{self.path}", headers=self.headers.items(), content=body
            )
        except (httpx.InvalidURL, ValueError) as exc:
            self._send(_error(400, f"Not a usable request target: {exc}", "BadRequestError"))
            return
        try:
            with self.server.lock:
                answer = self.server.fake(request)
        except Exception as exc:  # a body the fake cannot serve (its answers are not vLLM's validation)
            answer = _error(
                500, f"The fake vLLM cannot serve this request: {type(exc).__name__}: {exc}", "InternalServerError"
            )
        self._send(answer)

    def _send(self, answer: httpx.Response, *, close: bool = False) -> None:
        events = answer.headers.get("content-type", "").startswith("text/event-stream")
        self.send_response(answer.status_code)
        for name, value in answer.headers.multi_items():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        try:
            if not events:
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)
                return
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for position, event in enumerate(answer.content.split(b"\n\n")[:-1]):
                if position and self.server.closing.wait(self.server.stream_delay_s):
                    self.close_connection = True  # the server is closing: the stream is cut, not ended
                    return
                self.wfile.write(b"%x\r\n%s\n\n\r\n" % (len(event) + 2, event))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away (or the server is closing): nothing more to send
            self.close_connection = True


class FakeVLLMServer:
    """A ``FakeVLLM`` served on ``host`` (loopback by default) and a free port in a background thread:
    ``with FakeVLLMServer(fake) as server: TokenClient(server.base_url)``. Leaving the block closes
    the open connections and stops the threads."""

    def __init__(
        self, fake: FakeVLLM | None = None, *, host: str = "127.0.0.1", port: int = 0, stream_delay_s: float = 0.0
    ) -> None:
        self.fake = fake if fake is not None else FakeVLLM()
        self._address = (host, port)
        self._stream_delay_s = stream_delay_s
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's root, ``http://127.0.0.1:<port>`` (``/tokenize`` lives there)."""
        if self._server is None:
            raise RuntimeError("the fake vLLM server is not running: use it inside its 'with' block")
        return self._server.url

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL, ``<url>/v1``: for ``TokenClient``, the SDKs and the proxy."""
        return self.url + "/v1"

    def __enter__(self) -> FakeVLLMServer:
        self._server = bind(*self._address, self.fake, stream_delay_s=self._stream_delay_s)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-vllm-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()
        self._server = self._thread = None
