"""Reading a server's answer safely: bounded bodies, typed HTTP errors, redacted URLs.

A hostile or broken server can send a gzip bomb, an endless body, a redirect or an error page.
Bodies are read from the raw stream and decompressed here, a chunk at a time with the output
capped, so the limit holds after decompression and memory stays near it whatever the encoding
ratio. Any status outside 2xx is an error; redirects are never followed.
"""

from __future__ import annotations

import email.utils
import re
import time
import zlib
from typing import Any

import httpx
import msgspec

from ._errors import ContextLengthExceededError, MalformedResponseError, ResponseTooLargeError, ServerResponseError

__all__ = ["ACCEPT_ENCODING", "DEFAULT_MAX_RESPONSE_BYTES", "check_limit", "read_body", "redact", "strip_credentials"]

DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20
"""64 MiB. vLLM's answer to a 131,072-token prompt with 32,768 generated tokens, inline ids and
logprobs (each entry with its byte list) is about 5 MiB; this leaves room for n=8 groups of it."""

ACCEPT_ENCODING = "gzip, deflate"
"""What capture requests accept: the encodings decompressed here with a bounded output."""

_ERROR_BODY_BYTES = 64 * 2**10  # an error's body is read only this far (messages, not payloads)


_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")


def check_limit(owner: str, max_response_bytes: int) -> int:
    """``max_response_bytes`` if it is a positive int; ``ValueError`` naming ``owner`` otherwise."""
    if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
        raise ValueError(f"{owner}: max_response_bytes must be a positive int, not {max_response_bytes!r}")
    return max_response_bytes


def redact(text: str | httpx.URL) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (for messages, spans and logs)."""
    return _URL_PASSWORD.sub(r"\1***@", str(text))


def strip_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """``url`` without its ``user:password@`` part, and that part as basic auth (None when absent)."""
    parsed = httpx.URL(url)
    if not parsed.userinfo:
        return url, None
    return str(parsed.copy_with(username=None, password=None)), httpx.BasicAuth(parsed.username, parsed.password)


class _Inflate:
    """A gzip or deflate stream decompressed with its output capped per call."""

    def __init__(self, encoding: str, what: str) -> None:
        self._what = f"{what}: the {encoding}-encoded body"
        self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        self._raw_deflate_possible = encoding == "deflate"  # servers send zlib-wrapped or raw deflate

    def feed(self, data: bytes, room: int) -> list[bytes]:
        """Decompress ``data``: the pieces, which stop once they exceed ``room`` bytes together."""
        pieces: list[bytes] = []
        size = 0
        while data and size <= room:
            try:
                piece = self._zlib.decompress(data, room - size + 1)
            except zlib.error as exc:
                if self._raw_deflate_possible:
                    self._raw_deflate_possible = False
                    self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise MalformedResponseError(f"{self._what} does not decompress ({exc})") from exc
            self._raw_deflate_possible = False
            pieces.append(piece)
            size += len(piece)
            data = self._zlib.unconsumed_tail
        return pieces


async def read_body(response: httpx.Response, what: str, limit: int) -> bytes:
    """The body of a 2xx ``response`` (read from its raw stream, decompressed, at most ``limit``
    bytes after decompression), or a typed error: ``ServerResponseError`` for any other status
    (``ContextLengthExceededError`` for a context-length 400), ``ResponseTooLargeError`` over the
    limit, ``MalformedResponseError`` for an encoding that does not decode. Closes ``response``."""
    try:
        status = response.status_code
        if not 200 <= status < 300:
            body = await _read(response, what, _ERROR_BODY_BYTES, truncate=True)
            raise _status_error(response, body, what)
        return await _read(response, what, limit, truncate=False)
    finally:
        await response.aclose()


async def _read(response: httpx.Response, what: str, limit: int, *, truncate: bool) -> bytes:
    if response.is_stream_consumed:  # built in memory, already read and decoded (httpx.MockTransport)
        if len(response.content) > limit and not truncate:
            raise _too_large(response, what, limit, "the body is larger")
        return response.content[:limit]
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip", "deflate"):
        raise MalformedResponseError(
            f"{what}: the server sent Content-Encoding {encoding!r}; token capture accepts {ACCEPT_ENCODING} "
            "(the request says so in Accept-Encoding)"
        )
    declared = response.headers.get("content-length", "")
    if not truncate and encoding in ("identity", "") and declared.isdigit() and int(declared) > limit:
        raise _too_large(response, what, limit, f"it declares {int(declared):,} bytes")
    inflate = _Inflate(encoding, what) if encoding in ("gzip", "deflate") else None
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        pieces = [chunk] if inflate is None else inflate.feed(chunk, limit - size)
        for piece in pieces:
            parts.append(piece)
            size += len(piece)
        if size > limit:
            if truncate:
                break
            raise _too_large(response, what, limit, "the body is larger")
    return b"".join(parts)[:limit] if truncate else b"".join(parts)


def _too_large(response: httpx.Response, what: str, limit: int, detail: str) -> ResponseTooLargeError:
    return ResponseTooLargeError(
        f"{what}: the response from {redact(response.request.url)} is over max_response_bytes={limit:,} "
        f"after decompression ({detail}); raise max_response_bytes if responses this large are expected",
        limit=limit,
    )


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())


def _status_error(response: httpx.Response, data: bytes, what: str) -> ServerResponseError:
    status = response.status_code
    url = redact(response.request.url)
    if 300 <= status < 400:
        location = response.headers.get("location")
        return ServerResponseError(
            f"{what}: HTTP {status} redirect from {url} to {redact(location) if location else '(no Location)'}; "
            "token capture never follows redirects: point base_url at the final address",
            status_code=status,
            body=None,
        )
    body: Any
    try:
        body = msgspec.json.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        body = data.decode("utf-8", "replace")
    detail = body.get("error", body) if isinstance(body, dict) else body
    message = detail.get("message") if isinstance(detail, dict) else None
    text = redact(str(message if message is not None else body)[:2000])
    if status == 400 and (
        "context length" in text or (isinstance(detail, dict) and detail.get("param") == "input_tokens")
    ):
        return ContextLengthExceededError(
            f"{what}: the prompt does not fit the model's context: {text}", status_code=status, body=body
        )
    return ServerResponseError(
        f"{what}: HTTP {status} from {url}: {text}",
        status_code=status,
        body=body,
        retry_after=_retry_after(response) if status == 429 else None,
    )
