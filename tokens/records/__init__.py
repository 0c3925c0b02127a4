"""Durable token records: NeMo Gym 0.7.0's record protocols on SQLite (default) and PostgreSQL.

``open_store(url)`` gives one client that is a ``TokenSink``, a ``TokenSource`` and a
``LineageResolver`` at once (NeMo Gym's protocols, structurally); pass it as ``sink=`` to
``tokens.TokenClient`` or ``tokens.TokenCaptureTransport`` and each captured call is a
``TokenRecord`` (NeMo Gym's ``TokenEntry`` schema) before its response is handed back.
``read_rollout`` is the trainer's side: freeze, the token arrays and loss masks, conditional drop.
See docs/records.md.
"""

from ._coordinates import COORDINATE_FIELDS, COORDINATE_HEADERS, Coordinates, take_coordinates
from ._digest import compute_digest, compute_extras_digest, compute_staging_digest
from ._errors import (
    CoordinateError,
    MalformedRecordError,
    RecordConflictError,
    RecordSchemaError,
    RecordsError,
    RecordStoreError,
    RecordWriteError,
    RolloutFrozenError,
    RolloutRetiredError,
)
from ._fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from ._open import open_store
from ._order import order_records
from ._reader import RolloutSample, read_rollout
from ._record import (
    SCHEMA_VERSION,
    TokenRecord,
    cumulative_tokens,
    decode_record,
    encode_record,
    record_payload,
    weight_spans,
)
from ._store import RecordStore, RolloutSummary
from ._types import LineageMatch, LineageResolution, ParentResolutionStatus, TokenCaptureSnapshot
from ._writer import Custody, RecordWriter

__all__ = [
    "COORDINATE_FIELDS",
    "COORDINATE_HEADERS",
    "FINGERPRINT_VERSION",
    "SCHEMA_VERSION",
    "CoordinateError",
    "Coordinates",
    "Custody",
    "LineageMatch",
    "LineageResolution",
    "MalformedRecordError",
    "ParentResolutionStatus",
    "RecordConflictError",
    "RecordSchemaError",
    "RecordStore",
    "RecordStoreError",
    "RecordWriteError",
    "RecordWriter",
    "RecordsError",
    "RolloutFrozenError",
    "RolloutRetiredError",
    "RolloutSample",
    "RolloutSummary",
    "TokenCaptureSnapshot",
    "TokenRecord",
    "assistant_fingerprint",
    "compute_digest",
    "compute_extras_digest",
    "compute_staging_digest",
    "conversation_digest",
    "cumulative_tokens",
    "decode_record",
    "encode_record",
    "open_store",
    "order_records",
    "read_rollout",
    "record_payload",
    "take_coordinates",
    "weight_spans",
]
