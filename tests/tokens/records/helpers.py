"""Records made for the tests (roots and children with their lineage stamped)."""

from __future__ import annotations

from typing import Any

from tokens.records import TokenRecord, assistant_fingerprint, compute_digest, conversation_digest
from tokens.records._record import RESOLVED, ROOT

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def answer(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]


def make_record(
    rollout: str,
    call: str,
    prompt: list[int],
    generation: list[int],
    *,
    items: list[Any] | None = None,
    text: str = "a",
    parent: tuple[str, list[int]] | None = None,
    **extra: Any,
) -> TokenRecord:
    """A record as capture writes it; ``parent`` = (its id, its cumulative tokens) makes a delta child."""
    items = USER if items is None else items
    outputs = answer(text)
    full = prompt + generation
    lineage: dict[str, Any] = {"parent_resolution": ROOT}
    if parent is not None:
        parent_id, parent_tokens = parent
        assert prompt[: len(parent_tokens)] == parent_tokens
        lineage = {"parent_resolution": RESOLVED, "parent_call_id": parent_id, "prompt_is_delta": True}
        prompt = prompt[len(parent_tokens) :]
    fields = dict(cum_len=len(full), digest=compute_digest(full), **lineage) | extra
    return TokenRecord(
        rollout_id=rollout,
        model_call_id=call,
        model="m",
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=[-0.5] * len(generation),
        output_items=outputs,
        token_item_index=0,
        created_at=1700000000.0 + len(full),
        continuation_fingerprint=assistant_fingerprint(items + outputs),
        continuation_context_len=len(items),
        continuation_context_digest=conversation_digest(items),
        fingerprint_version=2,
        **fields,
    )
