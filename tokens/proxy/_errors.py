"""Typed errors of the capture proxy, and their bodies in each dialect (what the official SDKs parse).

Every error the proxy answers with is a ``ProxyError``: an HTTP status, an OpenAI error ``type``
and an Anthropic error ``type``. Their messages say what was wrong and what to do, and never name
the upstream (its URL or credentials): a client of the proxy is told the upstream failed, not where it lives.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import httpx

from .._errors import ResponseTooLargeError, ServerResponseError, TokensError

__all__ = [
    "CaptureFailedError",
    "ClientTimeoutError",
    "ContextWindowError",
    "ProxyBusyError",
    "ProxyError",
    "RequestRejectedError",
    "RequestTooLargeError",
    "RolloutCredentialError",
    "RolloutCredentialMissingError",
    "UpstreamError",
    "UpstreamTimeoutError",
    "anthropic_error_body",
    "openai_error_body",
    "upstream_error",
]


class ProxyError(TokensError):
    """An answer of the proxy that is an error: ``status``, ``openai_type``, ``anthropic_type``, ``param``."""

    status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"
    code: ClassVar[str | None] = None
    """OpenAI's error ``code`` (a string the clients branch on, such as ``context_length_exceeded``)."""

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        if status is not None:
            self.status = status  # type: ignore[misc]  # an upstream's own status, passed on

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers its answer carries besides the body (``Retry-After`` for a 429)."""
        return {}


class RequestRejectedError(ProxyError):
    """The request cannot be served as sent (a malformed body, an unsupported field); nothing went upstream."""

    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ContextWindowError(RequestRejectedError):
    """The upstream refused the prompt as longer than its context: said in the words each client's own
    fallback (compaction) looks for, OpenAI's ``context_length_exceeded`` code and Anthropic's
    ``prompt is too long``."""

    code = "context_length_exceeded"


class RequestTooLargeError(ProxyError):
    """The request body is over the proxy's ``max_request_bytes``."""

    status = 413
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


class ClientTimeoutError(ProxyError):
    """The client sent its request body too slowly (``client_timeout``)."""

    status = 408
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ProxyBusyError(ProxyError):
    """Too many requests in flight, in the proxy or in the request's rollout, and no room to wait
    (the queue is full, or the wait reached ``queue_timeout``); nothing was read or sent upstream.
    The answer's ``Retry-After`` says when to try again (the SDKs' retries honour it)."""

    status = 429
    openai_type = "rate_limit_exceeded"
    anthropic_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}


class RolloutCredentialError(ProxyError):
    """The request names a rollout, the proxy holds a rollout key, and the request's rollout token is
    not the one minted for that rollout (``mint_rollout_token``); nothing was read, recorded or sent."""

    status = 403
    openai_type = "permission_denied"
    anthropic_type = "permission_error"


class RolloutCredentialMissingError(RolloutCredentialError):
    """The request names a rollout without its rollout token, and the proxy requires one."""

    status = 401
    openai_type = "invalid_api_key"
    anthropic_type = "authentication_error"


class UpstreamError(ProxyError):
    """The upstream failed: unreachable, an HTTP error, a malformed or cut answer, or one capture cannot use."""

    status = 502
    openai_type = "upstream_error"
    anthropic_type = "api_error"


class CaptureFailedError(UpstreamError):
    """The upstream answered, but capture cannot give exact tokens from it (missing, partial or
    conflicting token metadata, a malformed or oversized answer); with a store, the rollout is marked incomplete."""


class UpstreamTimeoutError(UpstreamError):
    """The upstream did not answer (or went silent mid-stream) within ``upstream_timeout``."""

    status = 504
    openai_type = "upstream_timeout"
    anthropic_type = "timeout_error"


_ANTHROPIC_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                        503: "overloaded_error", 504: "timeout_error"}  # fmt: skip


_OPENAI_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                     422: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip


def _anthropic_type(error: ProxyError) -> str:
    if type(error) is ProxyError or type(error) is UpstreamError:
        return _ANTHROPIC_BY_STATUS.get(error.status, error.anthropic_type)
    return error.anthropic_type


def _openai_type(error: ProxyError) -> str:
    if type(error) is ProxyError:
        return _OPENAI_BY_STATUS.get(error.status, error.openai_type)
    return error.openai_type


def openai_error_body(error: ProxyError) -> dict[str, Any]:
    """OpenAI's error shape, which the ``openai`` SDK raises as the ``APIStatusError`` of the status
    (``code`` a string or null, as the SDK's ``ErrorObject`` has it)."""
    return {"error": {"message": str(error), "type": _openai_type(error), "param": error.param, "code": error.code}}


def anthropic_error_body(error: ProxyError) -> dict[str, Any]:
    """Anthropic's error shape (``{"type": "error", "error": {...}}``), as the ``anthropic`` SDK parses it."""
    return {"type": "error", "error": {"type": _anthropic_type(error), "message": str(error)}}


_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://\S+")


def _safe(text: str) -> str:
    """An upstream's message without any URL in it, at most 2,000 characters."""
    return _URL.sub("<url>", text)[:2000]


def upstream_error(exc: BaseException) -> ProxyError:
    """The client's view of an upstream failure: typed, with the upstream's status where it has one,
    never its URL; a failure of capture itself is a ``CaptureFailedError``."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeoutError(f"the upstream did not answer in time ({type(exc).__name__})")
    if isinstance(exc, httpx.HTTPError):
        return UpstreamError(f"the connection to the upstream failed ({type(exc).__name__})")
    if isinstance(exc, ServerResponseError):
        if 300 <= exc.status_code < 400:
            return UpstreamError(f"the upstream answered with a redirect (HTTP {exc.status_code}), not followed")
        detail = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else exc.body
        said = detail.get("message") if isinstance(detail, dict) else detail
        message = f"the upstream answered HTTP {exc.status_code}: {_safe(str(said))}"
        if exc.status_code == 400 and "maximum context length" in str(said):  # vLLM's words
            return ContextWindowError(f"prompt is too long: {message}", param="input_tokens")
        if exc.status_code >= 500 and exc.status_code != 503:
            return UpstreamError(message)  # a 502: the upstream failed
        return ProxyError(message, status=exc.status_code)  # its 4xx, or 503 (overloaded), passed on
    if isinstance(exc, ResponseTooLargeError):
        return CaptureFailedError(f"the upstream's answer is over the proxy's max_response_bytes={exc.limit:,}")
    return CaptureFailedError(f"token capture failed ({type(exc).__name__}): {_safe(str(exc))}")


for _cls in (
    ProxyError,
    CaptureFailedError,
    RequestRejectedError,
    RequestTooLargeError,
    ClientTimeoutError,
    ContextWindowError,
    ProxyBusyError,
    RolloutCredentialError,
    RolloutCredentialMissingError,
    UpstreamError,
    UpstreamTimeoutError,
):
    _cls.__module__ = "tokens.proxy"
