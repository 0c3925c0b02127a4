"""Spare sandboxes: under bwrap, one sandbox of the shape last asked for is made ahead, in the background.

Most of a bwrap sandbox's create is its command starter's start (bwrap, then a Python interpreter:
30-60 ms on a loaded machine). ``Spares`` keeps one sandbox of the shape the last create asked for
(its limits and view root: what its directory, cgroups, mounts, uid and starter are made of) ready,
so the next create of that shape takes it and only writes its record and makes its working
directory; the next spare is made behind it (shortly after, see ``_REFILL_AFTER_S``), one at a
time, in one background thread. A spare has run nothing: no command has started in it, nothing
else holds it. While it is a spare its directory holds ``SPARE_RECORD`` (its maker: host, pid,
start time, PID namespace) instead of the record ``list`` reads, so no listing shows it. Spares are
removed at ``aclose``, when the provider is collected or at interpreter exit (its finalizer), and,
when their process died without either, by the next provider made on the same base_dir or by
``reap`` (``LocalProvider.sweep_leftovers``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ._records import Box

__all__ = ["Spares"]

logger = logging.getLogger("sandbox_middleware")

# One thread makes and removes the spares of every provider of the process, one at a time: a spare is
# for the next create, which never waits for it (a create that finds none makes its own sandbox).
_MAKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spare-maker")
# A refill waits this long after the create that took the spare: the caller's first commands, which
# mostly follow a create at once, run before the next spare's start (bwrap, Python) competes with
# them for CPU (on 2 cores it doubled an exec and a close right after the create).
_REFILL_AFTER_S = 0.2
_MAKE_TIMEOUT_S = 60.0  # a spare's make is bounded by its starter's start (30 s) and a removal
Shape = TypeVar("Shape", bound=Hashable)  # what makes sandboxes interchangeable (the provider says)


class Spares(Generic[Shape]):
    """One provider's spare: ``make`` is a weak reference to the provider's method that builds a
    sandbox of a shape (blocking), so the provider can be collected and its finalizer call ``close``;
    ``discard(box)`` removes one. Both are called in the maker thread, ``discard`` also in ``close``'s."""

    def __init__(self, make: weakref.WeakMethod[Callable[[Shape], Box]], discard: Callable[[Box], None]) -> None:
        self._make = make
        self._discard = discard
        self._lock = threading.Condition()
        self._ready: tuple[Shape, Box] | None = None
        self._making = False
        self._closed = threading.Event()  # set by close: no spare is kept any more, a refill waiting gives up
        self._filler = 0  # the maker thread's ident, once it made one

    def offer(self, shape: Shape, box: Box) -> None:
        """Keep ``box`` as the spare of ``shape``; it is removed instead once closed or when one is kept."""
        with self._lock:
            keep = not self._closed.is_set() and self._ready is None
            if keep:
                self._ready = (shape, box)
        if not keep:
            self._discard(box)

    def take(self, shape: Shape) -> Box | None:
        """The spare, if it has ``shape`` and its starter lives (else None: one of another shape is removed)."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        if ready[0] == shape and ready[1].starter is not None and ready[1].starter.alive:
            return ready[1]
        self._submit(self._discard, ready[1])
        return None

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
            _MAKER.submit(_logged, work, *args)
        except RuntimeError:  # the interpreter is shutting down: close() removes what is left
            if work is self._discard:
                work(*args)
            return False
        return True

    def _fill(self, shape: Shape) -> None:
        self._filler = threading.get_ident()
        try:
            make = None if self._closed.wait(_REFILL_AFTER_S) else self._make()
            if make is None:  # closed meanwhile, or the provider is gone
                return
            box = make(shape)
            del make  # the provider's last reference may be this one: its finalizer closes us here
            self.offer(shape, box)
        finally:
            with self._lock:
                self._making = False
                self._lock.notify_all()

    def close(self) -> None:
        """Make no more spares and remove the one kept, after the one being made, if any (blocking)."""
        self._closed.set()
        with self._lock:
            if threading.get_ident() != self._filler:  # in the maker thread, the spare made is removed by offer
                self._lock.wait_for(lambda: not self._making, timeout=_MAKE_TIMEOUT_S)
            ready, self._ready = self._ready, None
        if ready is not None:
            self._discard(ready[1])


def _logged(work: Callable[..., None], *args: object) -> None:
    """Run background work; a failure is logged (a create of that shape fails the same way, and says why)."""
    try:
        work(*args)
    except Exception as exc:
        logger.debug("LocalProvider: a spare sandbox could not be made or removed: %s", exc)
