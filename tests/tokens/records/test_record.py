"""The record type and the digests, without NeMo Gym (tests/interop checks both against its code)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.tokens.records.helpers import make_record
from tokens.records import (
    MalformedRecordError,
    RecordSchemaError,
    TokenRecord,
    compute_digest,
    compute_extras_digest,
    compute_staging_digest,
    decode_record,
    encode_record,
    record_payload,
)

# NeMo Gym 0.7.0's staging/conformance/golden_vectors.json, as published.
GOLDEN_CALL: dict[str, Any] = {
    "schema_version": 2,
    "digest_version": 2,
    "extras_digest_version": 1,
    "rollout_id": "rollout-1",
    "model_call_id": "call-1",
    "parent_call_id": "parent-1",
    "mode": "token_in",
    "prev_len": 3,
    "delta_len": 2,
    "cum_len": 5,
    "weight_version": 7,
    "token_ids_delta": [10, 11],
    "token_mask_delta": [0.0, 1.0],
    "generation_log_probs_delta": [0.0, -0.25],
    "extras_digest": "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3",
    "chain_hash": "1" * 64,
    "cumulative_hash": "2" * 64,
}


def test_golden_vectors() -> None:
    assert compute_extras_digest({"routed_experts": [[[1, 2]], [[3, 4]]]}) == GOLDEN_CALL["extras_digest"]
    assert compute_staging_digest(**GOLDEN_CALL) == "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"
    assert compute_digest([1, 2, 3]) == "bf99633051449f0f3248b4995a7c8468b9561d7732447341916085f12ff9ff54"
    assert compute_digest([]) != compute_digest([0])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "text"}, "a root is a text-mode call"),
        ({"delta_len": 3}, "lengths disagree"),
        ({"token_mask_delta": [0.5, 1.0]}, "masks are 0.0 or 1.0"),
        ({"generation_log_probs_delta": [-1.0, -0.25]}, "prompt"),
        ({"schema_version": 3}, "unsupported staging versions"),
        ({"extras_digest": "XYZ"}, "lowercase SHA-256"),
        ({"token_ids_delta": [10, -1]}, "unsigned 64-bit"),
        ({"generation_log_probs_delta": [0.0, float("nan")]}, "finite"),
    ],
)
def test_staging_digest_refuses_what_it_cannot_encode(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_staging_digest(**{**GOLDEN_CALL, **change})


def test_extras_digest_refuses_ambiguous_values() -> None:
    for bad in ({"a": (1, 2)}, {"a": b"x"}, {"a": float("inf")}, {1: 2}):
        with pytest.raises((TypeError, ValueError)):
            compute_extras_digest(bad)  # type: ignore[arg-type]
    assert compute_extras_digest({"b": 1, "a": None}) == compute_extras_digest({"a": None, "b": 1})


def test_records_round_trip_and_refuse_newer_schemas() -> None:
    record = make_record("r", "c", [1, 2], [3], weight_versions=[{"version": "v", "start": 0, "end": 1}])
    data, sha = encode_record(record)
    assert record_payload(decode_record(data)) == record_payload(record)  # ours, or NeMo Gym's TokenEntry
    assert encode_record(decode_record(data)) == (data, sha)
    assert "weight_versions" not in record_payload(make_record("r", "c", [1], [2]))  # an extra field: absent if unset
    newer = msgspec.json.encode({**record_payload(record), "schema_version": 2})
    with pytest.raises(RecordSchemaError, match="schema_version 2; this reader understands up to 1"):
        decode_record(newer)
    with pytest.raises(MalformedRecordError, match="not JSON"):
        decode_record(b"{torn")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"generation_log_probs": []}, "1 generation ids but 0 log probabilities"),
        ({"parent_resolution": "resolved"}, "a resolved parent needs parent_call_id"),
        ({"parent_resolution": "root", "parent_call_id": "p"}, "cannot carry parent_call_id"),
        ({"prompt_is_delta": True}, "a delta prompt needs a resolved parent"),
        ({"token_item_index": 2}, "outside output_items"),
        ({"parent_resolution": "maybe"}, "is not root, resolved or unresolved"),
        ({"schema_version": 2}, "Upgrade the reader"),
    ],
)
def test_records_refuse_inconsistent_fields(fields: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "rollout_id": "r",
        "model_call_id": "c",
        "prompt_token_ids": [1],
        "generation_token_ids": [2],
        "generation_log_probs": [-1.0],
    }
    with pytest.raises((MalformedRecordError, RecordSchemaError), match=message):
        TokenRecord(**{**base, **fields})
