"""The TTL watchdog of LocalProvider: a daemon thread that ends each sandbox when its ``ttl_s`` runs out."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Watchdog"]

logger = logging.getLogger("sandbox_middleware")


class Watchdog:
    """One daemon thread per provider that calls ``expire(sandbox_id)`` when a sandbox's TTL runs out.

    It runs only while some sandbox has a deadline and needs no event loop, so a TTL holds even when
    nothing calls the provider.
    """

    def __init__(self, expire: Callable[[str], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, str]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, deadline: float, sandbox_id: str) -> None:
        with self._wake:
            heapq.heappush(self._heap, (deadline, sandbox_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sandbox-ttl", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self._heap:
                        return
                    deadline, sandbox_id = self._heap[0]
                    wait = deadline - time.monotonic()
                    if wait > 0:
                        self._wake.wait(min(wait, 3600.0))
                        continue
                    heapq.heappop(self._heap)
                try:
                    self._expire(sandbox_id)
                except Exception:  # a failed kill must not end the watchdog
                    logger.exception("sandbox TTL: could not end %s", sandbox_id)
        finally:
            with self._wake:
                self._thread = None
                if self._heap:  # something raced in after the last check: keep watching
                    self._thread = threading.Thread(target=self._run, name="sandbox-ttl", daemon=True)
                    self._thread.start()
