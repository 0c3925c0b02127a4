"""The pieces the dialect conversions share: an SSE event template gives the bytes of the whole event."""

from __future__ import annotations

from typing import Any

import pytest

from tokens.proxy._chat import HOLE, SSETemplate, sse

TEXTS = ["", "plain", 'quo"te \\ back', "line\nbreak\ttab", "\u00e9\u4e2d\U0001f600", "\x01\x1f control"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sequence", [0, 7, 123456])
def test_a_template_filled_is_the_event_encoded_whole(text: str, sequence: int) -> None:
    data: dict[str, Any] = {"type": "d", "sequence_number": HOLE, "item_id": "msg_1", "delta": HOLE, "logprobs": []}
    template = SSETemplate(data, "d")
    assert template(sequence, text) == sse({**data, "sequence_number": sequence, "delta": text}, "d")
    nested = {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": HOLE}}
    assert SSETemplate(nested)(text) == sse({**nested, "delta": {"type": "text_delta", "text": text}})


def test_a_template_takes_exactly_its_holes() -> None:
    template = SSETemplate({"a": HOLE, "b": HOLE})
    with pytest.raises(ValueError):
        template("only one")
