"""A token-capture proxy for agents that cannot be modified: Chat Completions, the Responses API and
Anthropic Messages in, exact token ids captured from vLLM, answers in the client's own dialect.

``create_app(upstream_url, store=...)`` is the ASGI app; ``python -m tokens.proxy --upstream URL``
serves it; ``ProxyServer`` serves it on a loopback port in a background thread (tests). Needs the
``proxy`` extra (``pip install 'llm-sandbox-middleware[proxy]'``). See docs/proxy.md.
"""

import sys

try:  # the proxy extra: without it, an ImportError naming it (python -m tokens.proxy: that one line, exit 2)
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as missing:
    _NEEDS = (f"tokens.proxy needs the 'proxy' extra ({missing.name} is not installed): "
              "pip install 'llm-sandbox-middleware[proxy]'")  # fmt: skip
    if sys.argv[:1] == ["-m"]:  # python -m tokens.proxy imports this package before its __main__
        print(f"python -m tokens.proxy: {_NEEDS}", file=sys.stderr)
        raise SystemExit(2) from None
    raise ImportError(_NEEDS, name=missing.name) from missing

from ..records import Coordinates
from ._app import DEFAULT_MAX_REQUEST_BYTES, create_app
from ._credentials import mint_rollout_token
from ._errors import (
    CaptureFailedError,
    ClientTimeoutError,
    ContextWindowError,
    ProxyBusyError,
    ProxyError,
    RequestRejectedError,
    RequestTooLargeError,
    RolloutCredentialError,
    RolloutCredentialMissingError,
    UpstreamError,
    UpstreamTimeoutError,
    anthropic_error_body,
    openai_error_body,
)
from ._event_stream import EventStream
from ._messages import MessagesEvents, chat_to_messages, messages_to_chat
from ._responses import ResponsesEvents, chat_to_responses, responses_to_chat
from ._server import ProxyServer
from ._sink import TokenSink

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "CaptureFailedError",
    "ClientTimeoutError",
    "ContextWindowError",
    "Coordinates",
    "EventStream",
    "MessagesEvents",
    "ProxyBusyError",
    "ProxyError",
    "ProxyServer",
    "RequestRejectedError",
    "RequestTooLargeError",
    "ResponsesEvents",
    "RolloutCredentialError",
    "RolloutCredentialMissingError",
    "TokenSink",
    "UpstreamError",
    "UpstreamTimeoutError",
    "anthropic_error_body",
    "chat_to_messages",
    "chat_to_responses",
    "create_app",
    "messages_to_chat",
    "mint_rollout_token",
    "openai_error_body",
    "responses_to_chat",
]
