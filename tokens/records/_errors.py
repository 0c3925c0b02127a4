"""Typed errors of ``tokens.records``: each says what was wrong, where, and what to do."""

from __future__ import annotations

from .._errors import TokensError, UnsupportedRequestError

__all__ = [
    "CoordinateError",
    "MalformedRecordError",
    "RecordConflictError",
    "RecordSchemaError",
    "RecordStoreError",
    "RecordWriteError",
    "RecordsError",
    "RolloutFrozenError",
    "RolloutRetiredError",
]


class RecordsError(TokensError):
    """Base class of the errors of ``tokens.records``."""


class RecordSchemaError(RecordsError):
    """A record was written with a newer schema than this reader understands; it is refused, not misread."""


class MalformedRecordError(RecordsError):
    """A record breaks the schema's rules (lengths, parent metadata, digests)."""


class RecordConflictError(RecordsError):
    """A model call id was put again with a different payload; the rollout is marked incomplete."""


class RolloutFrozenError(RecordsError):
    """The rollout is frozen (a consumer took its snapshot): no new record or call is accepted."""


class RolloutRetiredError(RecordsError):
    """The rollout was dropped after training consumed it: it accepts nothing and has no records."""


class RecordStoreError(RecordsError):
    """The store URL or the store itself is unusable (scheme, driver, schema)."""


class RecordWriteError(RecordsError):
    """A record could not be stored and the rollout could not be marked incomplete either: the
    call's tokens are lost without a durable trace, so the call fails rather than pretend."""


for _cls in (
    MalformedRecordError,
    RecordConflictError,
    RecordSchemaError,
    RecordStoreError,
    RecordWriteError,
    RecordsError,
    RolloutFrozenError,
    RolloutRetiredError,
):
    _cls.__module__ = "tokens.records"


class CoordinateError(UnsupportedRequestError):
    """A record coordinate (rollout id, model call id, parent call id, weight version) breaks the rule
    ``tokens.records.Coordinates`` checks; ``where`` names the field, header or URL part it came from."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where
