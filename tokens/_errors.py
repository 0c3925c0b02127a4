"""Typed errors of the token client: each says what was wrong, where, and what to do."""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChoiceCountError",
    "ConflictingTokenMetadataError",
    "ContextLengthExceededError",
    "MalformedResponseError",
    "MalformedTokenMetadataError",
    "MissingTokenMetadataError",
    "PartialTokenMetadataError",
    "ResponseTooLargeError",
    "ServerResponseError",
    "TokenCaptureError",
    "TokenIdsIgnoredError",
    "TokensError",
    "UnsupportedRequestError",
]


class TokensError(Exception):
    """Base class of every error the ``tokens`` package raises."""


class UnsupportedRequestError(TokensError):
    """The request asks for something token capture cannot serve (streaming, a bad ``n``); nothing was sent."""


class ServerResponseError(TokensError):
    """The server answered with an HTTP error; ``status_code`` and ``body`` are kept."""

    def __init__(self, message: str, *, status_code: int, body: Any, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.retry_after = retry_after


class ContextLengthExceededError(ServerResponseError):
    """The prompt (plus ``max_tokens``) does not fit the model's context; shorten it. Never retried."""


class ResponseTooLargeError(TokensError):
    """A response body is over ``max_response_bytes`` after decompression; reading stopped there."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class TokenCaptureError(TokensError):
    """The response's token metadata cannot give an exact bundle."""


class MalformedResponseError(TokenCaptureError):
    """The response body is not what was asked for: not JSON, nested too deep, not an object, no
    choices, an id that is not a 32-bit vocabulary index, a body that does not decompress."""


class ChoiceCountError(MalformedResponseError):
    """A request that asked for ``n`` choices got another number of them; ``requested`` and
    ``received`` say how many."""

    def __init__(self, message: str, *, requested: int, received: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.received = received


class PartialTokenMetadataError(TokenCaptureError):
    """A token source is present only in part (some of its fields missing)."""


class ConflictingTokenMetadataError(TokenCaptureError):
    """Two token sources in one response disagree."""


class MalformedTokenMetadataError(MalformedResponseError):
    """Token metadata of the wrong shape or type (not a list, a bad entry, a boolean for a number...)."""


class MissingTokenMetadataError(TokenCaptureError):
    """The response carries no token source at all (no logprobs, no inline ids)."""


class TokenIdsIgnoredError(TokenCaptureError):
    """Inline ids were requested (``return_token_ids``) but the server silently sent none."""


for _cls in (
    TokensError,
    UnsupportedRequestError,
    ServerResponseError,
    ContextLengthExceededError,
    ResponseTooLargeError,
    TokenCaptureError,
    MalformedResponseError,
    ChoiceCountError,
    PartialTokenMetadataError,
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    TokenIdsIgnoredError,
):
    _cls.__module__ = "tokens"
