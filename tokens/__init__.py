"""Token capture for OpenAI-compatible chat completions: exact ids and log probabilities for RL."""

from ._bundle import TokenBundle, TokenCompletion
from ._chain import (
    DEFAULT_CHAIN,
    Exchange,
    Handler,
    LogprobsSource,
    MessageBundleSource,
    TokenMiddleware,
    VLLMInlineSource,
    build_chain,
    require_bundle,
)
from ._client import RetryPolicy, TokenClient, prepare_request, server_root
from ._decode import DecodedResponse, MalformedResponseError, decode_response
from ._errors import (
    ConflictingTokenMetadataError,
    ContextLengthExceededError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    ServerResponseError,
    TokenCaptureError,
    TokensError,
    UnsupportedRequestError,
)

__all__ = [
    "DEFAULT_CHAIN",
    "ConflictingTokenMetadataError",
    "ContextLengthExceededError",
    "DecodedResponse",
    "Exchange",
    "Handler",
    "LogprobsSource",
    "MalformedResponseError",
    "MalformedTokenMetadataError",
    "MessageBundleSource",
    "MissingTokenMetadataError",
    "PartialTokenMetadataError",
    "RetryPolicy",
    "ServerResponseError",
    "TokenBundle",
    "TokenCaptureError",
    "TokenClient",
    "TokenCompletion",
    "TokenMiddleware",
    "TokensError",
    "UnsupportedRequestError",
    "VLLMInlineSource",
    "build_chain",
    "decode_response",
    "prepare_request",
    "require_bundle",
    "server_root",
]
