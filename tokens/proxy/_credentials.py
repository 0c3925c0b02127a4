"""Rollout credentials: with a rollout key, a request that names a rollout must carry its token.

The token of a rollout is HMAC-SHA256 of its id under the key, in hex (``mint_rollout_token``):
the trainer, which holds the key, mints one per rollout and gives the agent a base URL that
carries it, ``<proxy>/r/<rollout-id>/t/<token>/v1`` (any agent's base-URL setting carries a path),
or the client sends it as ``X-Rollout-Token``. The proxy recomputes it and compares in constant
time before reading the body: without the right token, a client cannot write into a rollout's
records (nor begin a call in it, nor take its places), whatever ids it knows.
"""

from __future__ import annotations

import hashlib
import hmac

from ._errors import RolloutCredentialError, RolloutCredentialMissingError

__all__ = ["MIN_KEY_BYTES", "ROLLOUT_KEY_ENV", "TOKEN_HEADER", "RolloutKey", "mint_rollout_token"]

ROLLOUT_KEY_ENV = "TOKENS_PROXY_ROLLOUT_KEY"
"""The environment variable ``python -m tokens.proxy`` reads the key from by default."""
TOKEN_HEADER = "x-rollout-token"
MIN_KEY_BYTES = 16


def _key_bytes(key: str | bytes, owner: str) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    if not isinstance(raw, bytes) or len(raw) < MIN_KEY_BYTES:
        raise ValueError(
            f'{owner}: a rollout key must be at least {MIN_KEY_BYTES} bytes (e.g. python -c "import secrets; '
            'print(secrets.token_hex(32))")'
        )
    return raw


def mint_rollout_token(key: str | bytes, rollout_id: str) -> str:
    """The token of ``rollout_id`` under ``key`` (at least 16 bytes; a ``str`` is taken as UTF-8):
    HMAC-SHA256 of the id, 64 hex digits, for ``/r/<rollout-id>/t/<token>/v1`` or ``X-Rollout-Token``."""
    return _token(_key_bytes(key, "mint_rollout_token"), rollout_id)


def _token(key: bytes, rollout_id: str) -> str:
    return hmac.new(key, rollout_id.encode(), hashlib.sha256).hexdigest()


class RolloutKey:
    """The proxy's rollout key: ``check`` refuses a rollout's request without that rollout's token."""

    def __init__(self, key: str | bytes) -> None:
        self._key = _key_bytes(key, "create_app: rollout_key")

    def check(self, rollout_id: str, token: str | None) -> None:
        """Nothing when ``token`` is ``rollout_id``'s; ``RolloutCredentialMissingError`` (401) without one,
        ``RolloutCredentialError`` (403) for another (compared in constant time)."""
        if not token:
            raise RolloutCredentialMissingError(
                f"rollout {rollout_id[:80]!r}: this proxy requires the rollout's token (minted by the trainer with "
                "tokens.proxy.mint_rollout_token): use the base URL /r/<rollout-id>/t/<token>/v1 or send "
                "X-Rollout-Token"
            )
        if not hmac.compare_digest(_token(self._key, rollout_id).encode(), token.encode("utf-8", "replace")):
            raise RolloutCredentialError(
                f"rollout {rollout_id[:80]!r}: the rollout token is not this rollout's (minted under another key, "
                "or for another rollout); ask the trainer for this rollout's base URL"
            )
