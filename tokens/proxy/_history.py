"""Where the proxy keeps the Responses turns a ``previous_response_id`` stands for: one small interface,
``ResponseHistory``, kept in this process's memory or in the record store.

A turn is what one answered request added to its conversation: its own ``input`` items and its
answer's output items (bundle fields removed), with the id of the answer it continued; a
``previous_response_id`` stands for the chain of turns back to its first, earliest first, and the
model call id that answered it; each turn also keeps the answer it was (without its bundle), served
again by ``GET /v1/responses/{id}``. ``MemoryHistory`` keeps the last ``entries`` turns of this
process, ``max_bytes`` of them at most together, JSON-encoded (so their size is known exactly and no
Python objects are held); asking a chain makes its turns the most recently used, its earliest last,
so eviction takes a chain's latest turns before those they continue, and an evicted turn is gone (no
later turn holds it);
``StoreHistory`` keeps them in a ``RecordStore`` (its ``token_responses`` table), so that every proxy
over the same store (SQLite on one machine, PostgreSQL across several) continues every conversation,
each turn for ``ttl_s`` seconds and at most ``max_turn_bytes``, the store's turns together at most
``max_turns`` and ``max_bytes`` (the oldest evicted first), a chain served up to ``max_chain_bytes``
together; a turn past its time or evicted is gone for every proxy, and a chain with a turn gone (or
over its bound) is refused (404), never served short.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, NamedTuple, Protocol

import msgspec

from ..records import RecordsError
from ._errors import ProxyError, RequestRejectedError

__all__ = [
    "DEFAULT_PREVIOUS_BYTES",
    "DEFAULT_PREVIOUS_RESPONSES",
    "DEFAULT_STORE_BYTES",
    "DEFAULT_STORE_RESPONSES",
    "DEFAULT_TTL_S",
    "MemoryHistory",
    "ResponseHistory",
    "StoreHistory",
    "history_for",
]

logger = logging.getLogger("tokens.proxy")

DEFAULT_PREVIOUS_RESPONSES = 1024
DEFAULT_PREVIOUS_BYTES = 256 * 2**20
"""256 MiB of turns kept in memory (each its own input and output, encoded): a thousand turns of a few hundred KiB."""
DEFAULT_STORE_RESPONSES = 1_000_000
DEFAULT_STORE_BYTES = 16 * 2**30
"""What a record store keeps of turns at most, for every proxy over it together: a million turns, 16 GiB
(a store serves a cluster's rollouts; the oldest turns go first)."""
DEFAULT_TTL_S = 86_400.0
"""A day: a store keeps each turn that long (an agent's episode is minutes to hours)."""
MAX_TURN_BYTES = 16 * 2**20
"""A turn (its input and output, encoded) larger than this is not kept in a store."""
MAX_CHAIN_BYTES = 64 * 2**20
"""A chain's turns together (what one request reads from a store) at most: twice the largest request body."""
MAX_TURNS = 100_000
"""The longest chain a store walks back."""

_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(list[Any])
_ANSWER = msgspec.json.Decoder(dict[str, Any])


class ResponseHistory(Protocol):
    """The turns of Responses conversations, by response id."""

    async def get(self, response_id: str) -> tuple[list[Any], str]:
        """The items the chain ending at ``response_id`` stands for, earliest first, and the model
        call id that answered ``response_id``; ``RequestRejectedError`` (404) when it is not kept."""
        ...

    async def put(
        self, response_id: str, items: list[Any], previous: str | None, call_id: str, answer: dict[str, Any]
    ) -> None:
        """Keep the turn ``response_id`` (``items``: its own input and output) continuing ``previous``,
        and ``answer``, the answer it was (without its bundle), for ``GET /v1/responses/{id}``."""
        ...

    async def answer(self, response_id: str) -> dict[str, Any]:
        """The answer kept with the turn ``response_id``; ``RequestRejectedError`` (404) when it is not kept."""
        ...


class _Turn(NamedTuple):
    items: bytes
    previous: str | None
    call_id: str
    answer: bytes


class MemoryHistory:
    """The last ``entries`` turns this process served (0: none), ``max_bytes`` at most together, in its memory."""

    def __init__(self, entries: int, max_bytes: int = DEFAULT_PREVIOUS_BYTES) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._kept = (
            f"the last {entries} turns this proxy served, {max_bytes:,} bytes at most, in memory "
            "(previous_responses, previous_bytes)"
        )

    async def get(self, response_id: str) -> tuple[list[Any], str]:
        chain: list[tuple[str, _Turn]] = []
        wanted: str | None = response_id
        while wanted is not None:
            turn = self._turns.get(wanted)
            if turn is None:
                raise _not_kept(response_id, wanted, self._kept)
            chain.append((wanted, turn))
            wanted = turn.previous
        for key, _ in chain:  # the latest turn first: its earliest is evicted last
            self._turns.move_to_end(key)
        return _joined(turn.items for _, turn in reversed(chain)), chain[0][1].call_id

    async def put(
        self, response_id: str, items: list[Any], previous: str | None, call_id: str, answer: dict[str, Any]
    ) -> None:
        if not self.entries:
            return
        turn = _Turn(_ENCODE.encode(items), previous, call_id, _ENCODE.encode(answer))
        if _size(turn) > self.max_bytes:  # larger than the bound alone: not kept
            return
        replaced = self._turns.pop(response_id, None)
        self.bytes += _size(turn) - (0 if replaced is None else _size(replaced))
        self._turns[response_id] = turn
        while len(self._turns) > self.entries or self.bytes > self.max_bytes:
            _, evicted = self._turns.popitem(last=False)
            self.bytes -= _size(evicted)

    async def answer(self, response_id: str) -> dict[str, Any]:
        turn = self._turns.get(response_id)
        if turn is None:
            raise _no_answer(response_id, self._kept)
        return _ANSWER.decode(turn.answer)


class StoreHistory:
    """Turns kept in a record store (``RecordStore.keep_response`` / ``response_chain``), each for
    ``ttl_s`` seconds and at most ``max_turn_bytes``, ``max_turns`` and ``max_bytes`` of them together in
    the store (every proxy's), a chain up to ``max_chain_bytes`` together; every proxy over the store
    serves them."""

    def __init__(
        self,
        store: Any,
        ttl_s: float = DEFAULT_TTL_S,
        max_turns: int = DEFAULT_STORE_RESPONSES,
        max_bytes: int = DEFAULT_STORE_BYTES,
        max_turn_bytes: int = MAX_TURN_BYTES,
        max_chain_bytes: int = MAX_CHAIN_BYTES,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_turns = max_turns
        self.max_bytes = max_bytes
        self.max_turn_bytes = max_turn_bytes
        self.max_chain_bytes = max_chain_bytes

    async def get(self, response_id: str) -> tuple[list[Any], str]:
        try:
            chain = await self.store.response_chain(response_id, max_turns=MAX_TURNS, max_bytes=self.max_chain_bytes)
        except RecordsError as exc:
            raise _store_failed(response_id, exc, "previous_response_id's turns") from None
        kept = f"turns kept in the record store for {self.ttl_s:g} s, chains of {self.max_chain_bytes:,} bytes at most"
        if not chain:
            raise _not_kept(response_id, response_id, kept)
        if chain[-1][1] is not None:
            raise _not_kept(response_id, chain[-1][1], kept)
        return _joined(items for _, _, items, _ in reversed(chain)), chain[0][3]

    async def put(
        self, response_id: str, items: list[Any], previous: str | None, call_id: str, answer: dict[str, Any]
    ) -> None:
        encoded, kept = _ENCODE.encode(items), _ENCODE.encode(answer)
        if len(encoded) + len(kept) > self.max_turn_bytes:
            logger.warning(
                "tokens.proxy: response %r is not kept for previous_response_id: its turn is %d bytes, over %d",
                response_id,
                len(encoded) + len(kept),
                self.max_turn_bytes,
            )
            return
        try:
            await self.store.keep_response(
                response_id,
                encoded,
                previous,
                call_id,
                kept,
                ttl_s=self.ttl_s,
                max_turns=self.max_turns,
                max_bytes=self.max_bytes,
            )
        except RecordsError as exc:  # the answer still goes out (its record is written); a continuation gets 404
            logger.warning("tokens.proxy: keeping response %r in the record store failed: %s", response_id[:80], exc)

    async def answer(self, response_id: str) -> dict[str, Any]:
        try:
            kept = await self.store.kept_answer(response_id)
        except RecordsError as exc:
            raise _store_failed(response_id, exc, "the kept answer") from None
        if kept is None:
            raise _no_answer(response_id, f"turns kept in the record store for {self.ttl_s:g} s")
        return _ANSWER.decode(kept)


def history_for(store: Any, entries: int | None, max_bytes: int | None, ttl_s: float) -> ResponseHistory:
    """The store's history when ``store`` keeps turns (a ``RecordStore``), else this process's memory:
    ``entries`` turns at most (0: none kept anywhere), ``max_bytes`` together; None, the default of
    where they are kept (``DEFAULT_STORE_*``, ``DEFAULT_PREVIOUS_*``)."""
    keeps = all(callable(getattr(store, name, None)) for name in ("keep_response", "response_chain", "kept_answer"))
    if entries != 0 and keeps:
        return StoreHistory(
            store,
            ttl_s,
            DEFAULT_STORE_RESPONSES if entries is None else entries,
            DEFAULT_STORE_BYTES if max_bytes is None else max_bytes,
        )
    return MemoryHistory(
        DEFAULT_PREVIOUS_RESPONSES if entries is None else entries,
        DEFAULT_PREVIOUS_BYTES if max_bytes is None else max_bytes,
    )


def _size(turn: _Turn) -> int:
    return len(turn.items) + len(turn.answer)


def _joined(turns: Any) -> list[Any]:
    items: list[Any] = []
    for encoded in turns:
        items += _DECODE.decode(encoded)
    return items


def _not_kept(response_id: str, missing: str, kept: str) -> RequestRejectedError:
    where = "" if missing == response_id else f" (its chain's earlier turn {missing[:80]!r} is no longer kept)"
    return RequestRejectedError(
        f"previous_response_id: {response_id[:80]!r} is not held by this proxy{where}: it serves {kept}; send "
        "the whole conversation as input instead",
        param="previous_response_id",
        status=404,
    )


def _no_answer(response_id: str, kept: str) -> RequestRejectedError:
    return RequestRejectedError(
        f"response_id: {response_id[:80]!r} is not held by this proxy: it keeps the answers of {kept}; the "
        "call's record (its rollout in the record store) has what was answered",
        param="response_id",
        status=404,
    )


def _store_failed(response_id: str, exc: RecordsError, what: str) -> ProxyError:
    logger.warning("tokens.proxy: reading response %r from the record store failed: %s", response_id[:80], exc)
    return ProxyError(f"the record store failed ({type(exc).__name__}) reading {what}; retry the call", status=503)
