"""A snapshot's records in chain order, each with its turn's bundle (delta prompts rebuilt and
checked against their digests): what the reader and ``Trajectory.from_snapshot`` both start from."""

from __future__ import annotations

from collections.abc import Iterable

from .._bundle import LOG_PROB_FLOOR, TokenBundle
from ._errors import MalformedRecordError
from ._record import TokenRecord, check_digest, cumulative_tokens, weight_spans

__all__ = ["order_records"]


def order_records(entries: Iterable[TokenRecord]) -> list[tuple[TokenRecord, TokenBundle]]:
    """Records in chain order (a parent before its children, siblings and separate roots by
    ``created_at``), each with its turn's bundle: the whole prompt rebuilt from delta records."""
    records = list(entries)
    by_id = {record.model_call_id: record for record in records}
    if len(by_id) != len(records):
        raise MalformedRecordError("a snapshot holds two records with one model_call_id; it is not a snapshot")
    children: dict[str | None, list[TokenRecord]] = {}
    for record in records:
        parent = record.parent_call_id if record.parent_call_id in by_id else None
        children.setdefault(parent, []).append(record)
    ordered: list[tuple[TokenRecord, TokenBundle]] = []
    cumulative: dict[str, list[int]] = {}
    stack = sorted(children.get(None, []), key=_created, reverse=True)
    while stack:
        record = stack.pop()
        if record.prompt_is_delta and record.parent_call_id not in cumulative:
            raise MalformedRecordError(
                f"record {record.model_call_id!r} stores a delta prompt but its parent "
                f"{record.parent_call_id!r} is not in the snapshot; it cannot be rebuilt"
            )
        parent_tokens = cumulative.get(record.parent_call_id or "", [])
        tokens = cumulative_tokens(record, parent_tokens if record.prompt_is_delta else ())
        check_digest(record, tokens)
        cumulative[record.model_call_id] = tokens
        prompt = tokens[: len(tokens) - len(record.generation_token_ids)]
        floored = tuple(i for i, value in enumerate(record.generation_log_probs) if value <= LOG_PROB_FLOOR)
        ordered.append(
            (
                record,
                TokenBundle(
                    prompt,
                    list(record.generation_token_ids),
                    list(record.generation_log_probs),
                    "record",
                    record.routed_experts,
                    floored,
                    weight_spans(record),
                ),
            )
        )
        stack.extend(sorted(children.get(record.model_call_id, []), key=_created, reverse=True))
    if len(ordered) != len(records):
        raise MalformedRecordError("the snapshot's parent links form a cycle; the records are corrupt")
    return ordered


def _created(record: TokenRecord) -> tuple[float, str]:
    return record.created_at, record.model_call_id
