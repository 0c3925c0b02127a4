"""``TokenRecord``: one model call's training tokens, NeMo Gym's ``TokenEntry`` schema version 1.

Field for field NeMo Gym's record, with one addition carried the way its schema carries unknown
fields (``extra="allow"``): ``weight_versions``, spans ``{"version", "start", "end"}`` of
generation tokens sampled by weights labelled ``version`` (vLLM's format); ``dropped``: what
the capture proxy left out of the request before sending it upstream (a hosted tool, ...), each
``{"where", "type", "reason"}``; and ``served_by``, the upstream replica (its base URL, credentials
stripped) that served the call. Records are stored as
sorted-key JSON of their fields (``encode_record``); reading refuses a newer schema
(``RecordSchemaError``) rather than misreading it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from .._bundle import WeightVersionSpan
from ._digest import compute_digest
from ._errors import MalformedRecordError, RecordSchemaError
from ._types import NEMO_TOKEN_ENTRY

__all__ = [
    "SCHEMA_VERSION",
    "TokenRecord",
    "cumulative_tokens",
    "decode_record",
    "encode_record",
    "record_payload",
    "weight_spans",
]

SCHEMA_VERSION = 1
ROOT, RESOLVED, UNRESOLVED = "root", "resolved", "unresolved"


class TokenRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One model call's content and exact tokens (NeMo Gym's ``TokenEntry``, schema version 1).

    ``prompt_token_ids`` is the whole prompt, or only its part after the parent's cumulative
    tokens when ``prompt_is_delta`` (then ``parent_resolution`` is ``resolved``). ``digest`` is
    ``compute_digest`` of the whole prompt + generation and ``cum_len`` its length.
    ``parent_resolution`` (``root``, ``resolved``, ``unresolved``) and ``parent_resolution_reason``
    are the request-time decision; the ``continuation_*`` fields are the lookup metadata a
    continuation is resolved by.
    """

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = msgspec.field(default_factory=list)
    token_item_index: int | None = None
    response_id: str | None = None
    created_at: float = 0.0
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: str | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False
    weight_versions: list[dict[str, Any]] | None = None
    dropped: list[dict[str, Any]] | None = None
    served_by: str | None = None

    def __post_init__(self) -> None:
        where = f"record {self.rollout_id!r}/{self.model_call_id!r}"
        if self.schema_version != SCHEMA_VERSION:
            raise RecordSchemaError(
                f"{where} is schema_version {self.schema_version}; this reader understands {SCHEMA_VERSION}. "
                "Upgrade the reader, or read records written by a matching writer"
            )
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise MalformedRecordError(
                f"{where}: {len(self.generation_token_ids)} generation ids but "
                f"{len(self.generation_log_probs)} log probabilities"
            )
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise MalformedRecordError(f"{where}: token_item_index {self.token_item_index} is outside output_items")
        if self.parent_resolution not in (None, ROOT, RESOLVED, UNRESOLVED):
            raise MalformedRecordError(
                f"{where}: parent_resolution {self.parent_resolution!r} is not root, resolved or unresolved"
            )
        if self.parent_resolution == RESOLVED and not self.parent_call_id:
            raise MalformedRecordError(f"{where}: a resolved parent needs parent_call_id")
        if self.parent_resolution in (ROOT, UNRESOLVED) and self.parent_call_id is not None:
            raise MalformedRecordError(f"{where}: a {self.parent_resolution} record cannot carry parent_call_id")
        if self.prompt_is_delta and self.parent_resolution != RESOLVED:
            raise MalformedRecordError(f"{where}: a delta prompt needs a resolved parent to rebuild from")


_ENCODER = msgspec.json.Encoder(order="sorted")
_DECODER = msgspec.json.Decoder()


def record_payload(record: Any) -> dict[str, Any]:
    """A record's fields as JSON values: ours (``TokenRecord``) or NeMo Gym's ``TokenEntry``."""
    if isinstance(record, TokenRecord):
        payload: dict[str, Any] = msgspec.to_builtins(record)
        for extra in ("weight_versions", "dropped", "served_by"):
            if payload[extra] is None:
                del payload[extra]  # an extra field: absent unless set, as in NeMo Gym's dump
        return payload
    dump = getattr(record, "model_dump", None)
    if dump is None:
        raise TypeError(f"a record is a TokenRecord or NeMo Gym's TokenEntry, not {type(record).__name__}")
    result: dict[str, Any] = dump(mode="json")
    return result


def encode_record(record: Any) -> tuple[bytes, str]:
    """The stored bytes of a record (sorted-key JSON) and their SHA-256: byte-identical re-puts
    are the same call; anything else under the same id is a conflict."""
    data = _ENCODER.encode(record_payload(record))
    return data, hashlib.sha256(data).hexdigest()


def decode_record(data: bytes | str) -> TokenRecord:
    """A stored record: NeMo Gym's ``TokenEntry`` when NeMo Gym is installed, else ``TokenRecord``
    (the type checker sees ``TokenRecord``; both have the same attributes)."""
    try:
        payload = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise MalformedRecordError(f"a stored record is not JSON ({exc}); the store is corrupt") from exc
    if not isinstance(payload, dict):
        raise MalformedRecordError("a stored record is not a JSON object; the store is corrupt")
    version = payload.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version > SCHEMA_VERSION:
        raise RecordSchemaError(
            f"record {payload.get('rollout_id')!r}/{payload.get('model_call_id')!r} is schema_version {version!r}; "
            f"this reader understands up to {SCHEMA_VERSION}. Upgrade the reader"
        )
    if NEMO_TOKEN_ENTRY is not None:
        entry: TokenRecord = NEMO_TOKEN_ENTRY.model_validate(payload)
        return entry
    try:
        return msgspec.convert(payload, TokenRecord)
    except msgspec.ValidationError as exc:
        raise MalformedRecordError(f"a stored record does not fit schema version 1: {exc}") from exc


def cumulative_tokens(record: TokenRecord, parent_tokens: Sequence[int] = ()) -> list[int]:
    """The whole sequence (prompt + generation) a child must start with; a delta record needs
    its parent's (``parent_tokens``)."""
    prompt = list(parent_tokens) + record.prompt_token_ids if record.prompt_is_delta else record.prompt_token_ids
    return prompt + record.generation_token_ids


def check_digest(record: TokenRecord, tokens: Sequence[int]) -> None:
    """The rebuilt cumulative tokens must have the recorded digest and length."""
    if record.digest is not None and (compute_digest(tokens) != record.digest or record.cum_len != len(tokens)):
        raise MalformedRecordError(
            f"record {record.rollout_id!r}/{record.model_call_id!r}: its rebuilt tokens ({len(tokens)}) do not "
            f"have its digest and cum_len ({record.cum_len}); the record or its parent chain is corrupt"
        )


def weight_spans(record: TokenRecord) -> tuple[WeightVersionSpan, ...]:
    """The record's ``weight_versions`` as spans (empty when none were recorded)."""
    spans = getattr(record, "weight_versions", None) or []
    try:
        return tuple(WeightVersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans)
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRecordError(f"record {record.model_call_id!r}: malformed weight_versions {spans!r}") from exc
