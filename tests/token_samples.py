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
        nested = {key: "mapping" if key == "top_logprobs" else keys(item) for key, item in value.items()
                  if isinstance(item, (dict, list))}  # fmt: skip
        return nested | {"": sorted(value)}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [keys(value[0])]
    return None
