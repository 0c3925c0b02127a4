"""The cumulative tokens of recorded calls, kept by a store client so a long rollout's parents are
not rebuilt from the whole delta chain at every turn. Records never change once stored (a retired
rollout takes no new ones), so an entry never goes stale; the least recently used go first once
the token budget is spent."""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["TokenCache"]

Key = tuple[str, str]


class TokenCache:
    def __init__(self, max_tokens: int) -> None:
        self._max = max_tokens
        self._held = 0
        self._entries: OrderedDict[Key, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key) -> tuple[int, ...] | None:
        with self._lock:
            tokens = self._entries.get(key)
            if tokens is not None:
                self._entries.move_to_end(key)
            return tokens

    def put(self, key: Key, tokens: tuple[int, ...]) -> None:
        if len(tokens) > self._max:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            self._held += len(tokens) - (len(previous) if previous is not None else 0)
            self._entries[key] = tokens
            while self._held > self._max:
                _, dropped = self._entries.popitem(last=False)
                self._held -= len(dropped)
