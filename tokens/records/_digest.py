"""NeMo Gym's published digests, computed from its byte layouts (its golden vectors check them).

``compute_digest`` hashes an exact token sequence (a record's ``digest`` is that of its prompt +
generation); ``compute_staging_digest`` and ``compute_extras_digest`` are the staged-call digests
of NeMo Gym's ``staging/conformance/golden_vectors.json``. Every encoding is versioned and
length-delimited, big-endian; floats of a staged call are IEEE-754 float32 bit patterns.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DIGEST_VERSION",
    "EXTRAS_DIGEST_VERSION",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "compute_digest",
    "compute_extras_digest",
    "compute_staging_digest",
]

DIGEST_VERSION = 1
STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

_TOKENS_DOMAIN = b"nemo-gym-tokens"
_CALL_DOMAIN = b"nemo-gym-staging-call-v2"
_EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
_U64_MAX = 2**64 - 1
_EMPTY = hashlib.sha256(_TOKENS_DOMAIN).hexdigest()


def _u64s(values: Sequence[int], what: str) -> bytes:
    try:
        return struct.pack(f">{len(values)}Q", *values)
    except struct.error:
        bad = next(v for v in values if type(v) is not int or not 0 <= v <= _U64_MAX)
        raise ValueError(f"{what} must be unsigned 64-bit ints, got {bad!r}") from None


def compute_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of an exact token sequence (NeMo Gym's record ``digest``; the empty sequence has its own)."""
    if not token_ids:
        return _EMPTY
    header = struct.pack(">BQ", DIGEST_VERSION, len(token_ids))
    return hashlib.sha256(_TOKENS_DOMAIN + header + _u64s(token_ids, "token ids")).hexdigest()


def _sized(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _text(value: str) -> bytes:
    if type(value) is not str:
        raise TypeError(f"expected text, got {type(value).__name__}")
    return _sized(value.encode("utf-8"))


def _u64(value: int, what: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise ValueError(f"{what} must be an unsigned 64-bit integer, got {value!r}")
    return struct.pack(">Q", value)


def _hex(value: str, what: str) -> bytes:
    if type(value) is not str or len(value) != 64 or value.strip("0123456789abcdef"):
        raise ValueError(f"{what} must be a lowercase SHA-256 hex digest, got {value!r}")
    return bytes.fromhex(value)


def _float32s(values: Sequence[float], what: str) -> bytes:
    for value in values:
        if type(value) is not float or not math.isfinite(value) or abs(value) > 3.4028234663852886e38:
            raise ValueError(f"{what} values must be finite floats representable as float32, got {value!r}")
    return _u64(len(values), f"{what} length") + struct.pack(f">{len(values)}f", *values)


def _extra(value: Any) -> bytes:
    kind = type(value)
    if value is None:
        return b"N"
    if kind is bool:
        return b"B\x01" if value else b"B\x00"
    if kind is int:
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"extras integer is outside the signed 64-bit range: {value}")
        return b"I" + struct.pack(">q", value)
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"extras floats must be finite, got {value!r}")
        return b"F" + struct.pack(">d", value)
    if kind is str:
        return b"S" + _text(value)
    if kind is list:
        return b"L" + _u64(len(value), "extras list length") + b"".join(map(_extra, value))
    if kind is dict:
        if any(type(key) is not str for key in value):
            raise TypeError("extras mappings must have string keys")
        keys = sorted(value, key=lambda key: key.encode("utf-8"))
        return b"D" + _u64(len(keys), "extras mapping length") + b"".join(_text(k) + _extra(value[k]) for k in keys)
    raise TypeError(f"extras hold an unsupported value type {kind.__name__} (JSON values only: no tuples, bytes, NaN)")


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """SHA-256 of a staged call's extras (``routed_experts`` and the like): a typed binary encoding."""
    if extras is not None and not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    payload = struct.pack(">B", EXTRAS_DIGEST_VERSION) + _extra(None if extras is None else dict(extras))
    return hashlib.sha256(_EXTRAS_DOMAIN + payload).hexdigest()


def _check_staged(fields: Mapping[str, Any]) -> None:
    """The rules of a staged call (``compute_staging_digest``'s arguments, by name)."""
    schema_version, digest_version, extras_digest_version = (
        fields["schema_version"],
        fields["digest_version"],
        fields["extras_digest_version"],
    )
    rollout_id, model_call_id, parent_call_id, mode = (
        fields["rollout_id"],
        fields["model_call_id"],
        fields["parent_call_id"],
        fields["mode"],
    )
    prev_len, delta_len, cum_len = fields["prev_len"], fields["delta_len"], fields["cum_len"]
    token_ids_delta, token_mask_delta, generation_log_probs_delta = (
        fields["token_ids_delta"],
        fields["token_mask_delta"],
        fields["generation_log_probs_delta"],
    )
    versions = (schema_version, digest_version, extras_digest_version)
    if versions != (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION):
        raise ValueError(f"unsupported staging versions (schema, digest, extras) {versions}; this writes (2, 2, 1)")
    if not rollout_id or not model_call_id or parent_call_id == "":
        raise ValueError("rollout_id, model_call_id and a present parent_call_id must be non-empty")
    if mode not in ("text", "token_in"):
        raise ValueError(f"unsupported capture mode {mode!r} (text or token_in)")
    root = parent_call_id is None
    if (root and (prev_len != 0 or mode != "text")) or (not root and (prev_len == 0 or mode != "token_in")):
        raise ValueError("a root is a text-mode call with prev_len 0; a child is token_in with prev_len > 0")
    if delta_len == 0 or delta_len != len(token_ids_delta) or cum_len != prev_len + delta_len:
        raise ValueError(
            f"lengths disagree: delta_len {delta_len}, {len(token_ids_delta)} ids, cum_len {cum_len}, "
            f"prev_len {prev_len} (a delta holds at least one token; cum_len = prev_len + delta_len)"
        )
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise ValueError("token ids, masks and log probabilities must have equal lengths")
    for mask, log_prob in zip(token_mask_delta, generation_log_probs_delta, strict=True):
        if mask not in (0.0, 1.0) or (mask == 0.0 and log_prob != 0.0):
            raise ValueError("masks are 0.0 or 1.0, and a prompt (mask 0.0) token's log probability is 0.0")


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """SHA-256 of one staged call delta (NeMo Gym's staging schema 2, digest version 2)."""
    _check_staged(locals())
    parent = b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id)
    ids = _u64(len(token_ids_delta), "token_ids length") + _u64s(token_ids_delta, "token_ids_delta")
    payload = b"".join(
        (
            struct.pack(">BBB", schema_version, digest_version, extras_digest_version),
            _text(rollout_id),
            _text(model_call_id),
            parent,
            _text(mode),
            _u64(prev_len, "prev_len"),
            _u64(delta_len, "delta_len"),
            _u64(cum_len, "cum_len"),
            _u64(weight_version, "weight_version"),
            _sized(ids),
            _sized(_float32s(token_mask_delta, "token_mask_delta")),
            _sized(_float32s(generation_log_probs_delta, "generation_log_probs_delta")),
            _hex(extras_digest, "extras_digest"),
            b"\x01" + _hex(chain_hash, "chain_hash"),
            b"\x01" + _hex(cumulative_hash, "cumulative_hash"),
        )
    )
    return hashlib.sha256(_CALL_DOMAIN + payload).hexdigest()
