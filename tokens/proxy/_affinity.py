"""Several replicas of one upstream: a rollout's calls on one replica, failover, health with backoff.

A model's ``Replicas`` are ordered per call by rendezvous hashing of its affinity key (the
``X-Session-Id`` header, else the rollout id, else the call's own id): every call with the same key
asks the same replica first, so its prefix stays in that replica's cache, and a replica that leaves
moves only the keys it held. A replica that refused the connection or answered 5xx before anything
was sent to the client (``fails_over``) is marked down for a backoff (``BACKOFF_S``, doubled for
each failure in a row, at most ``MAX_BACKOFF_S``) and asked only after the healthy ones until then;
its first success clears it. A call that fails over is asked of the next replica in its order.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

import httpx

from .._errors import ServerResponseError, TokensError

__all__ = ["BACKOFF_S", "MAX_BACKOFF_S", "SESSION_HEADER", "Replica", "Replicas", "fails_over"]

logger = logging.getLogger("tokens.proxy")


class _Upstream(Protocol):
    base: str
    """Its base URL, credentials stripped: the replica's name in records."""


T = TypeVar("T")
U = TypeVar("U", bound=_Upstream)

SESSION_HEADER = "x-session-id"
BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


class Replica(Generic[U]):
    """One replica: its upstream, its name in records (the base URL, credentials stripped), its health."""

    def __init__(self, upstream: U) -> None:
        self.upstream = upstream
        self.name = upstream.base
        self.failures = 0
        self.down_until = 0.0


class Replicas(Generic[U]):
    """The replicas that serve one model, each asked in an order of the call's affinity key."""

    def __init__(self, upstreams: Sequence[U], clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas = tuple(Replica(upstream) for upstream in upstreams)
        self._clock = clock

    def order(self, key: str) -> list[Replica[U]]:
        """Every replica, once: the healthy ones by rendezvous weight for ``key``, then those marked down."""
        ranked = sorted(self.replicas, key=lambda replica: _weight(key, replica.name), reverse=True)
        now = self._clock()
        return [r for r in ranked if r.down_until <= now] + [r for r in ranked if r.down_until > now]

    def failed(self, replica: Replica[U]) -> None:
        """Mark ``replica`` down for its backoff (doubled for each failure in a row)."""
        replica.failures += 1
        replica.down_until = self._clock() + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (replica.failures - 1))

    @staticmethod
    def succeeded(replica: Replica[U]) -> None:
        replica.failures, replica.down_until = 0, 0.0

    async def ask(self, key: str, ask: Callable[[U], Awaitable[T]]) -> tuple[T, Replica[U]]:
        """``ask`` of each replica in ``key``'s order until one answers: its answer and the replica. What
        a replica raised that does not fail over is raised; so is the last one's, when every one failed."""
        order = self.order(key)
        for tried, replica in enumerate(order, 1):
            try:
                answer = await ask(replica.upstream)
            except (TokensError, httpx.HTTPError) as exc:
                if not fails_over(exc):
                    raise
                self.failed(replica)
                if tried == len(order):
                    raise
                logger.warning(
                    "tokens.proxy: upstream replica %d of %d failed (%s); asking the next",
                    tried,
                    len(order),
                    type(exc).__name__,
                )
                continue
            self.succeeded(replica)
            return answer, replica
        raise AssertionError("a model has at least one replica")  # pragma: no cover


def _weight(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest(), "big")


def fails_over(exc: BaseException) -> bool:
    """Whether a call that failed with ``exc`` (before anything was sent to the client) is asked of
    the next replica: the replica refused or dropped the connection, or answered 5xx."""
    if isinstance(exc, ServerResponseError):
        return exc.status_code >= 500
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.RemoteProtocolError | httpx.ReadError)
