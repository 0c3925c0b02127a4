"""The Responses answers the proxy keeps for ``previous_response_id``, bounded in entries and in bytes.

Each answer is kept as its own turn only: the items its request added (its ``input``) and its
answer's output, without bundle fields, JSON-encoded (so its size is known exactly and no Python
objects are held), with the id of the answer it continued. A ``previous_response_id`` stands for
the chain of turns back to its first one, decoded when asked; a chain is served while each of its
turns is kept. Asking a chain makes all its turns the most recently used, its earliest last, so
eviction (the least recently used turn first, once there are more than ``entries`` or more than
``max_bytes`` together) takes a chain's latest turns before the turns they continue, and an
evicted turn is gone: no later turn holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec

from ._errors import RequestRejectedError

__all__ = ["DEFAULT_PREVIOUS_BYTES", "DEFAULT_PREVIOUS_RESPONSES", "PreviousResponses"]

DEFAULT_PREVIOUS_RESPONSES = 1024
DEFAULT_PREVIOUS_BYTES = 256 * 2**20
"""256 MiB of turns (each its own input and output, encoded): a thousand turns of a few hundred KiB."""

_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(list[Any])


class _Turn(NamedTuple):
    items: bytes
    previous: str | None
    call_id: str


class PreviousResponses:
    """At most ``entries`` turns of at most ``max_bytes`` together, by response id (0 entries: none kept)."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._turns: OrderedDict[str, _Turn] = OrderedDict()

    def get(self, response_id: str) -> tuple[list[Any], str]:
        """The items the chain ending at ``response_id`` stands for, earliest first, and the model call
        id that answered ``response_id``; ``RequestRejectedError`` (404) when a turn of it is not kept."""
        chain: list[tuple[str, _Turn]] = []
        wanted: str | None = response_id
        while wanted is not None:
            turn = self._turns.get(wanted)
            if turn is None:
                raise RequestRejectedError(
                    _not_kept(response_id, wanted, self), param="previous_response_id", status=404
                )
            chain.append((wanted, turn))
            wanted = turn.previous
        items: list[Any] = []
        for _, turn in reversed(chain):
            items += _DECODE.decode(turn.items)
        for key, _ in chain:  # the latest turn first: its earliest is evicted last
            self._turns.move_to_end(key)
        return items, chain[0][1].call_id

    def put(self, response_id: str, items: list[Any], previous: str | None, call_id: str) -> None:
        """Keep the turn ``response_id`` (``items``: its input and output) continuing ``previous``; one
        larger than ``max_bytes`` alone is not kept."""
        if not self.entries:
            return
        encoded = _ENCODE.encode(items)
        if len(encoded) > self.max_bytes:
            return
        self._turns[response_id] = _Turn(encoded, previous, call_id)
        self.bytes += len(encoded)
        while len(self._turns) > self.entries or self.bytes > self.max_bytes:
            _, evicted = self._turns.popitem(last=False)
            self.bytes -= len(evicted.items)


def _not_kept(response_id: str, missing: str, kept: PreviousResponses) -> str:
    where = "" if missing == response_id else f" (its chain's earlier turn {missing[:80]!r} was evicted)"
    return (
        f"previous_response_id: {response_id[:80]!r} is not held by this proxy{where}: it keeps the last "
        f"{kept.entries} turns, {kept.max_bytes:,} bytes at most, in memory; send the whole conversation as "
        "input instead"
    )
