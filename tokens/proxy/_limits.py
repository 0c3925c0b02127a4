"""How many requests the proxy serves at once: in all, and per rollout, with a bounded queue.

A request is admitted before its body is read and holds its place until its answer's last byte
(a stream's too): at most ``max_requests`` in the proxy and ``max_rollout_requests`` in one
rollout. One that finds no place waits for one, in order, while fewer than ``max_queued`` wait and
for ``queue_timeout`` at most; otherwise it is a ``ProxyBusyError`` (429, ``Retry-After``). Since a
request's working memory is a small multiple of its body, this bounds the proxy's memory with
``max_request_bytes`` and ``max_response_bytes`` (docs/proxy.md gives the bound).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from ._errors import ProxyBusyError

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_MAX_ROLLOUT_REQUESTS",
    "DEFAULT_QUEUE_TIMEOUT",
    "Admission",
]

DEFAULT_MAX_REQUESTS = 256
"""Requests served at once by one proxy (each holds its body and its answer in memory): room for a
few hundred rollouts' calls in flight, each waiting on vLLM for seconds to minutes."""
DEFAULT_MAX_ROLLOUT_REQUESTS = 16
"""Requests served at once for one rollout: an agent and its subagents, not a flood under one id."""
DEFAULT_MAX_QUEUED = 1024
"""Requests waiting for a place, in all (a waiting request's body is not read yet)."""
DEFAULT_QUEUE_TIMEOUT = 300.0
"""Seconds a request waits for a place before its 429 (calls ahead of it are generations, not pings)."""


@dataclass
class _Rollout:
    places: anyio.CapacityLimiter
    users: int = 0


class Admission:
    """The places: ``max_requests`` in the proxy, ``max_rollout_requests`` per rollout, ``max_queued``
    waiting for ``queue_timeout`` seconds at most."""

    def __init__(self, max_requests: int, max_rollout_requests: int, max_queued: int, queue_timeout: float) -> None:
        self.max_rollout_requests = max_rollout_requests
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.proxy = anyio.CapacityLimiter(max_requests)
        self.waiting = 0
        self._rollouts: dict[str, _Rollout] = {}  # only those with a request in flight or waiting

    @asynccontextmanager
    async def admit(self, rollout_id: str | None) -> AsyncIterator[None]:
        """A place in the rollout's (if any) and then the proxy's, held for the block; ``ProxyBusyError``
        when there is none and no room or time to wait for one."""
        holder = object()
        held: list[anyio.CapacityLimiter] = []
        places = [(self.proxy, "the proxy")]
        if rollout_id is not None:
            rollout = self._rollouts.get(rollout_id)
            if rollout is None:
                rollout = self._rollouts[rollout_id] = _Rollout(anyio.CapacityLimiter(self.max_rollout_requests))
            rollout.users += 1
            places.insert(0, (rollout.places, f"rollout {rollout_id[:80]!r}"))
        try:
            for limiter, what in places:
                await self._take(limiter, holder, what)
                held.append(limiter)
            yield
        finally:
            for limiter in held:
                limiter.release_on_behalf_of(holder)
            if rollout_id is not None:
                self._rollouts[rollout_id].users -= 1
                if not self._rollouts[rollout_id].users:
                    del self._rollouts[rollout_id]

    async def _take(self, limiter: anyio.CapacityLimiter, holder: object, what: str) -> None:
        try:
            limiter.acquire_on_behalf_of_nowait(holder)
            return
        except anyio.WouldBlock:
            pass
        limit = f"{what} serves {int(limiter.total_tokens)} requests at once"
        if self.waiting >= self.max_queued:
            raise ProxyBusyError(
                f"too many requests: {limit} and {self.max_queued} more are waiting; retry later",
                retry_after=1,
            )
        self.waiting += 1
        try:
            with anyio.fail_after(self.queue_timeout):
                await limiter.acquire_on_behalf_of(holder)
        except TimeoutError:
            raise ProxyBusyError(
                f"too many requests: {limit} and none ended within queue_timeout={self.queue_timeout:g} s; retry later",
                retry_after=self.queue_timeout / 10,
            ) from None
        finally:
            self.waiting -= 1
