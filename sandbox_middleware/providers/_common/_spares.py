"""Spares: sandboxes of the shape the last create asked for, made ahead in one background thread.

A provider whose create spends most of its time in something a sandbox needs before anything runs
in it (LocalProvider: its command starter's start; DockerProvider: the container's create and
start) keeps ``count`` of the shape last asked for ready (one by default), so the next creates of
that shape take them; the next are made behind them (``refill_after_s`` later), one at a time, in one
thread that serves
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
        count: int = 1,
        refill_after_s: float = 0.2,
    ) -> None:
        self._make = make
        self._discard = discard
        self._count = count
        self._refill_after_s = refill_after_s
        self._lock = threading.Condition()
        self._shape: Shape | None = None  # the shape of the spares kept
        self._ready: list[Item] = []
        self._making = False
        self._closed = threading.Event()  # set by close: no spare is kept any more, a refill waiting gives up
        self._filler = 0  # the maker thread's ident, once it made one

    def usable(self, item: Item) -> bool:
        """Whether a spare of the right shape may be handed out (the provider's subclass says more)."""
        return True

    def offer(self, shape: Shape, item: Item) -> None:
        """Keep ``item`` as a spare of ``shape``; it is removed instead once closed, when ``count`` are
        kept, or when those kept have another shape."""
        with self._lock:
            keep = not self._closed.is_set() and len(self._ready) < self._count
            keep = keep and (not self._ready or self._shape == shape)
            if keep:
                self._shape = shape
                self._ready.append(item)
        if not keep:
            self._discard(item)

    def take(self, shape: Shape) -> Item | None:
        """A spare, if those kept have ``shape`` and one is usable (else None: those of another shape,
        and unusable ones, are removed)."""
        while True:
            with self._lock:
                if not self._ready:
                    return None
                fits = self._shape == shape
                unfit = [self._ready.pop(0)] if fits else self._ready
                if not fits:
                    self._ready = []
            if fits and self.usable(unfit[0]):
                return unfit[0]
            for item in unfit:
                self.discard(item)
            if not fits:
                return None

    def discard(self, item: Item) -> None:
        """Remove a spare taken but found unfit, in the maker thread."""
        self._submit(self._discard, item)

    def refill(self, shape: Shape) -> None:
        """After a create of ``shape`` succeeded: make spares of that shape until ``count`` are kept,
        unless they are being made."""
        with self._lock:
            if self._closed.is_set() or self._making or self._full(shape):
                return
            self._making = True
        if not self._submit(self._fill, shape, self._refill_after_s):
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

    def _fill(self, shape: Shape, after_s: float) -> None:
        """Make spares of ``shape`` after ``after_s``, one after another, until ``count`` are kept."""
        self._filler = threading.get_ident()
        try:
            if self._closed.wait(after_s):
                return
            while True:
                with self._lock:
                    if self._closed.is_set() or self._full(shape):
                        return
                make = self._make()
                if make is None:  # the provider is gone
                    return
                item = make(shape)
                del make  # the provider's last reference may be this one: its finalizer closes us here
                self.offer(shape, item)
        finally:
            with self._lock:
                self._making = False
                self._lock.notify_all()

    def _full(self, shape: Shape) -> bool:
        """Whether no spare of ``shape`` is to be made now (under the lock): ``count`` are kept, or those
        kept have another shape (the next create of ``shape`` removes them, then refills)."""
        return len(self._ready) >= self._count or (bool(self._ready) and self._shape != shape)

    def wait(self, timeout_s: float) -> bool:
        """Wait until no spare is being made (at most ``timeout_s``): whether one is kept now."""
        with self._lock:
            self._lock.wait_for(lambda: not self._making, timeout=timeout_s)
            return bool(self._ready)

    def close(self) -> None:
        """Make no more spares and remove the one kept, after the one being made, if any (blocking)."""
        self._closed.set()
        with self._lock:
            if threading.get_ident() != self._filler:  # in the maker thread, the spare made is removed by offer
                self._lock.wait_for(lambda: not self._making, timeout=_MAKE_TIMEOUT_S)
            ready, self._ready = self._ready, []
        for item in ready:
            self._discard(item)

    def _logged(self, work: Callable[..., None], *args: object) -> None:
        """Run background work; a failure is logged (a create of that shape fails the same way, and says why)."""
        try:
            work(*args)
        except Exception as exc:
            logger.debug("%s: a spare sandbox could not be made or removed: %s", self.who, exc)
