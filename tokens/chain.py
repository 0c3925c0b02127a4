"""The extraction chain's extension API: what a token source or check is made of.

A response is decoded once (``decode_response``) into an ``Exchange``; each step of the chain is a
``TokenMiddleware`` over it, and the innermost handler (``require_bundle``) turns the candidates the
sources found into a ``TokenBundle``. ``DEFAULT_CHAIN`` is what ``TokenClient`` and
``TokenCaptureTransport`` run; pass your own list (``middleware=``) to add a source for another
server, or a check. The ``extract_*`` steps are the pure functions behind the sources, usable on
their own. ``prepare_request`` and ``server_root`` are what a front end of its own needs.

Most users need none of this: ``tokens`` itself has the client, the transport, the stream, the
trajectory and the errors.
"""

from ._bundle import LOG_PROB_FLOOR
from ._capture import prepare_request, server_root
from ._chain import (
    DEFAULT_CHAIN,
    DynamoSource,
    LogProbFloorCheck,
    LogprobsSource,
    MessageBundleSource,
    SGLangSource,
    UsageCheck,
    VLLMInlineSource,
    build_chain,
    extract_dynamo,
    extract_message_bundle,
    extract_sglang,
    extract_vllm_inline,
)
from ._decode import MAX_TOKEN_ID, DecodedResponse, decode_response
from ._exchange import Candidate, Exchange, Handler, TokenMiddleware, require_bundle
from ._vllm_responses import (
    ResponsesAnswer,
    VLLMResponsesSource,
    decode_responses,
    extract_vllm_responses,
    prepare_responses_request,
)

__all__ = [
    "DEFAULT_CHAIN",
    "LOG_PROB_FLOOR",
    "MAX_TOKEN_ID",
    "Candidate",
    "DecodedResponse",
    "DynamoSource",
    "Exchange",
    "Handler",
    "LogProbFloorCheck",
    "LogprobsSource",
    "MessageBundleSource",
    "ResponsesAnswer",
    "SGLangSource",
    "TokenMiddleware",
    "UsageCheck",
    "VLLMInlineSource",
    "VLLMResponsesSource",
    "build_chain",
    "decode_response",
    "decode_responses",
    "extract_dynamo",
    "extract_message_bundle",
    "extract_sglang",
    "extract_vllm_inline",
    "extract_vllm_responses",
    "prepare_request",
    "prepare_responses_request",
    "require_bundle",
    "server_root",
]
