"""Spares: one sandbox of the shape the last create asked for, made ahead in one background thread.

A provider whose create spends most of its time in something a sandbox needs before anything runs
in it (LocalProvider: its command starter's start; DockerProvider: the container's create and
start) keeps one of the shape last asked for ready, so the next create of that shape takes it; the
next spare is made behind it (``refill_after_s`` later), one at a time, in one thread that serves
every provider of the process. What makes sandboxes interchangeable (the ``Shape``), how one is
made, told usable and removed, and what keeps an untaken spare out of ``list`` are the provider's
(``local/_spares.py``, ``docker/_spares.py``). A spare has run nothing the caller asked for.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Spares"]

logger = logging.getLogger("sandbox_middleware")

# One thread makes and removes the spares of every provider of the process, one at a time: a spare is
# for the next create, which never waits for it (a create that finds none makes its own sandbox).
_MAKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spare-maker")
_MAKE_TIMEOUT_S = 60.0  # how long close waits for the spare being made (its make is bounded by the provider)
Shape = TypeVar("Shape", bound=Hashable)  # what makes sandboxes interchangeable (the provider says)
Item = TypeVar("Item")  # one spare sandbox, as the provider holds it


class Spares(Generic[Shape, Item]):
    """One provider's spare: ``make`` is a weak reference to the provider's method that builds a
    sandbox of a shape (blocking), so the provider can be collected and its finalizer call ``close``;
    ``discard(item)`` removes one. Both are called in the maker thread, ``discard`` also in ``close``'s.
    ``who`` names the provider in what is logged (a subclass's). A refill waits ``refill_after_s`` after the create
    that took the spare: the caller's first commands, which mostly follow a create at once, run before
    the next spare's make competes with them for CPU (on 2 cores it doubled an exec and a close right
    after the create)."""

    who = "a provider"

    def __init__(
        self,
        make: weakref.WeakMethod[Callable[[Shape], Item]],
        discard: Callable[[Item], None],
        *,
        refill_after_s: float = 0.2,
    ) -> None:
        self._make = make
        self._discard = discard
        self._refill_after_s = refill_after_s
        self._lock = threading.Condition()
        self._ready: tuple[Shape, Item] | None = None
        self._making = False
        self._closed = threading.Event()  # set by close: no spare is kept any more, a refill waiting gives up
        self._filler = 0  # the maker thread's ident, once it made one

    def usable(self, item: Item) -> bool:
        """Whether a spare of the right shape may be handed out (the provider's subclass says more)."""
        return True

    def offer(self, shape: Shape, item: Item) -> None:
        """Keep ``item`` as the spare of ``shape``; it is removed instead once closed or when one is kept."""
        with self._lock:
            keep = not self._closed.is_set() and self._ready is None
            if keep:
                self._ready = (shape, item)
        if not keep:
            self._discard(item)

    def take(self, shape: Shape) -> Item | None:
        """The spare, if it has ``shape`` and is usable (else None: one of another shape is removed)."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        if ready[0] == shape and self.usable(ready[1]):
            return ready[1]
        self.discard(ready[1])
        return None

    def discard(self, item: Item) -> None:
        """Remove a spare taken but found unfit, in the maker thread."""
        self._submit(self._discard, item)

    def refill(self, shape: Shape) -> None:
        """After a create of ``shape`` succeeded: make a spare of that shape, unless one is kept or being made."""
        with self._lock:
            if self._closed.is_set() or self._making or self._ready is not None:
                return
            self._making = True
        if not self._submit(self._fill, shape):
            with self._lock:
                self._making = False
                self._lock.notify_all()

    def _submit(self, work: Callable[..., None], *args: object) -> bool:
        try:
            _MAKER.submit(self._logged, work, *args)
        except RuntimeError:  # the interpreter is shutting down: close() removes what is left
            if work is self._discard:
                work(*args)
            return False
        return True

    def _fill(self, shape: Shape) -> None:
        self._filler = threading.get_ident()
        try:
            make = None if self._closed.wait(self._refill_after_s) else self._make()
            if make is None:  # closed meanwhile, or the provider is gone
                return
            item = make(shape)
            del make  # the provider's last reference may be this one: its finalizer closes us here
            self.offer(shape, item)
        finally:
            with self._lock:
                self._making = False
                self._lock.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait until no spare is being made (at most ``timeout_s``): whether one is kept now."""
        with self._lock:
            self._lock.wait_for(lambda: not self._making, timeout=timeout_s)
            return self._ready is not None

    def close(self) -> None:
        """Make no more spares and remove the one kept, after the one being made, if any (blocking)."""
        self._closed.set()
        with self._lock:
            if threading.get_ident() != self._filler:  # in the maker thread, the spare made is removed by offer
                self._lock.wait_for(lambda: not self._making, timeout=_MAKE_TIMEOUT_S)
            ready, self._ready = self._ready, None
        if ready is not None:
            self._discard(ready[1])

    def _logged(self, work: Callable[..., None], *args: object) -> None:
        """Run background work; a failure is logged (a create of that shape fails the same way, and says why)."""
        try:
            work(*args)
        except Exception as exc:
            logger.debug("%s: a spare sandbox could not be made or removed: %s", self.who, exc)
