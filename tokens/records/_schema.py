"""The tables of a record store; ``{blob}``, ``{float}`` and ``{int}`` are the engine's types.

Every statement is idempotent (``IF NOT EXISTS``), and a store runs them all when its newest table
(``LATEST``) is missing: that is its schema migration. A store made before a table was added gets it
the first time a newer client connects; tables are only ever added, never changed.
"""

from __future__ import annotations

__all__ = ["LATEST", "ddl"]

LATEST = "token_responses_usage"
"""The newest table: a store without it is migrated (every statement below run) on connect."""

_DDL = (
    "CREATE TABLE IF NOT EXISTS token_rollouts (rollout_id TEXT PRIMARY KEY, version {int} NOT NULL, "
    "frozen {int} NOT NULL, retired {int} NOT NULL, incomplete {int} NOT NULL, snapshot_id TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS token_records (rollout_id TEXT NOT NULL, model_call_id TEXT NOT NULL, "
    "payload {blob} NOT NULL, payload_sha TEXT NOT NULL, fingerprint TEXT, fingerprint_version {int}, "
    "context_len {int} NOT NULL, context_digest TEXT NOT NULL, cum_len {int}, digest TEXT, parent_call_id TEXT, "
    "written_at {float} NOT NULL, PRIMARY KEY (rollout_id, model_call_id))",
    "CREATE INDEX IF NOT EXISTS token_records_fingerprint ON token_records (rollout_id, fingerprint)",
    "CREATE TABLE IF NOT EXISTS token_marks (rollout_id TEXT NOT NULL, model_call_id TEXT NOT NULL, "
    "reason TEXT NOT NULL, marked_at {float} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS token_marks_rollout ON token_marks (rollout_id)",
    "CREATE TABLE IF NOT EXISTS token_intents (rollout_id TEXT NOT NULL, model_call_id TEXT NOT NULL, "
    "PRIMARY KEY (rollout_id, model_call_id))",
    # The capture proxy's previous_response_id turns (each its own input and output items, JSON, and the
    # answer it was, for GET /v1/responses/{id}), so
    # that any proxy over the store continues a conversation; expired rows are deleted as turns are kept.
    "CREATE TABLE IF NOT EXISTS token_responses (response_id TEXT PRIMARY KEY, previous_id TEXT, "
    "model_call_id TEXT NOT NULL, items {blob} NOT NULL, answer {blob} NOT NULL, expires_at {float} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS token_responses_expiry ON token_responses (expires_at)",
    # What token_responses holds (its turns and their bytes), kept with every change so that the bound on
    # the whole table is checked in one read: one row, counted from the table when it is made.
    "CREATE TABLE IF NOT EXISTS token_responses_usage (id {int} PRIMARY KEY, turns {int} NOT NULL, "
    "bytes {int} NOT NULL)",
    "INSERT INTO token_responses_usage (id, turns, bytes) SELECT 1, COUNT(*), "
    "COALESCE(SUM(LENGTH(items) + LENGTH(answer)), 0) FROM token_responses WHERE true ON CONFLICT (id) DO NOTHING",
)


def ddl(*, blob: str, float_: str, int_: str) -> list[str]:
    return [statement.format(blob=blob, float=float_, int=int_) for statement in _DDL]
