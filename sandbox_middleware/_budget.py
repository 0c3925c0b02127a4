"""``RetryBudget``: gRPC-style retry throttling shared by every call through one retry layer."""

from __future__ import annotations

from typing import ClassVar

from ._bounds import POSITIVE, Bounds
from ._errors import SandboxArgumentError

__all__ = ["RetryBudget"]


class RetryBudget:
    """A token bucket that stops retries while a provider keeps failing.

    Each retryable failure spends one token, each success earns ``token_ratio`` back (capped at
    ``max_tokens``), and a retry is allowed only while more than half of ``max_tokens`` remain,
    as in gRPC's retry throttling. Under a sustained outage at most about ``max_tokens / 2``
    retries happen in all, however many callers there are; retries resume once enough successes
    have refilled the bucket.
    """

    __slots__ = ("_tokens", "max_tokens", "token_ratio")
    BOUNDS: ClassVar[Bounds] = Bounds("RetryBudget", max_tokens=POSITIVE, token_ratio=POSITIVE)

    def __init__(self, max_tokens: float = 100.0, token_ratio: float = 0.1) -> None:
        self.BOUNDS.check(locals())
        if token_ratio > max_tokens:
            raise SandboxArgumentError(f"RetryBudget: token_ratio must be in (0, max_tokens], not {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self._tokens = self.max_tokens

    def __repr__(self) -> str:
        return f"RetryBudget(max_tokens={self.max_tokens:g}, token_ratio={self.token_ratio:g}, tokens={self._tokens:g})"

    @property
    def tokens(self) -> float:
        return self._tokens

    def on_failure(self) -> bool:
        """Spend a token for a retryable failure; return whether a retry is allowed now."""
        self._tokens = max(0.0, self._tokens - 1.0)
        return self._tokens > self.max_tokens / 2

    def on_success(self) -> None:
        self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)
