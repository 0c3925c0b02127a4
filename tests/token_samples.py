"""The recorded vLLM 0.32 bodies and the mocked server's URLs shared by the token-capture tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32"
BASE = "http://vllm.test:8000/v1"
CHAT = "http://vllm.test:8000/v1/chat/completions"
TOKENIZE = "http://vllm.test:8000/tokenize"


def sample(name: str) -> Any:
    return json.loads((FIXTURES / f"{name}.json").read_text())


INLINE = sample("chat_inline_ids.response")
LOGPROBS_ONLY = sample("chat_logprobs_only.response")
TOKENIZED = sample("tokenize_chat.response")


def keys(value: Any) -> Any:
    """The field names of ``value`` at every level (a list by its first item). The completions API's
    ``top_logprobs`` maps token texts to numbers: data, not fields, so only its kind is compared."""
    if isinstance(value, dict):
        nested = {
            key: "mapping" if key == "top_logprobs" else keys(item)
            for key, item in value.items()
            if isinstance(item, (dict, list))
        }
        return nested | {"": sorted(value)}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [keys(value[0])]
    return None


RECORDED_EXCHANGES = [
    ("chat_inline_ids", "/v1/chat/completions"), ("chat_logprobs_only", "/v1/chat/completions"),
    ("chat_n2_inline_ids", "/v1/chat/completions"), ("chat_top_logprobs_null", "/v1/chat/completions"),
    ("completions_token_in", "/v1/completions"), ("tokenize_chat", "/tokenize"), ("detokenize", "/detokenize"),
    ("error_context_length", "/v1/chat/completions"), ("error_max_tokens", "/v1/chat/completions"),
]  # fmt: skip
"""The recorded requests a fake vLLM must answer with the recorded answers' field sets, and their paths."""


def recorded_request(name: str, vocabulary: int) -> Any:
    """A recorded request whose token ids are moved into a fake's ``vocabulary`` (ids 0 to vocabulary - 1)."""
    request = sample(f"{name}.request")
    for key in ("tokens", "prompt"):
        if isinstance(request.get(key), list):
            request[key] = [t % vocabulary for t in request[key]]
    return request
