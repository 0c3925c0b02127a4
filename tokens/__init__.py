"""Token capture for OpenAI-compatible chat completions: exact ids and log probabilities for RL.

The chain's extension API (``Exchange``, ``Candidate``, the sources and ``extract_*`` steps) is the
public module ``tokens.chain``.
"""

from . import chain, records
from ._bundle import TokenBundle, TokenCompletion, WeightVersionSpan
from ._client import RetryPolicy, TokenClient
from ._errors import (
    ChoiceCountError,
    ConflictingTokenMetadataError,
    ContextLengthExceededError,
    MalformedResponseError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    ResponseTooLargeError,
    ServerResponseError,
    TokenCaptureError,
    TokenIdsIgnoredError,
    TokensError,
    UnsupportedRequestError,
)
from ._http import DEFAULT_MAX_RESPONSE_BYTES
from ._stream import TokenStream
from ._transport import TokenCaptureTransport
from .records._trajectory import Drift, DriftPolicy, Segment, Trajectory, TrajectoryDriftError

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "ChoiceCountError",
    "ConflictingTokenMetadataError",
    "ContextLengthExceededError",
    "Drift",
    "DriftPolicy",
    "MalformedResponseError",
    "MalformedTokenMetadataError",
    "MissingTokenMetadataError",
    "PartialTokenMetadataError",
    "ResponseTooLargeError",
    "RetryPolicy",
    "Segment",
    "ServerResponseError",
    "TokenBundle",
    "TokenCaptureError",
    "TokenCaptureTransport",
    "TokenClient",
    "TokenCompletion",
    "TokenIdsIgnoredError",
    "TokenStream",
    "TokensError",
    "Trajectory",
    "TrajectoryDriftError",
    "UnsupportedRequestError",
    "WeightVersionSpan",
    "chain",
    "records",
]
