"""Creates made as one group: ``Sandbox.fork``'s ``n`` creates, each of which is of use only once all are
made (the caller runs them together, holding the parent and every fork made so far meanwhile).

A layer that takes something for each create and can run out of it (``AdmissionMiddleware``'s held
slots) takes it for the whole group in one step: two groups waiting on one limit then never each hold
part of what both need (with ``max_held=10``, two parents forking 4 each could otherwise take 2 slots
apiece and wait for the others forever). The group is a context variable, so every create started in
its block (the tasks its creates run in inherit it) finds it; a layer keeps its own state in
``share`` and what it must give back at the end in ``on_end``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["CreateGroup", "create_group", "current_group"]

logger = logging.getLogger("sandbox_middleware")

T = TypeVar("T")

_GROUP: contextvars.ContextVar[CreateGroup | None] = contextvars.ContextVar("sandbox_middleware_group", default=None)


class CreateGroup:
    """``size`` creates made together; ``made`` of them returned so far (what a layer still has to
    take something for is ``size - made``); ``parent_id``: the sandbox they are forks of, held while
    they are made."""

    def __init__(self, size: int, parent_id: str | None = None) -> None:
        self.size, self.made, self.parent_id = size, 0, parent_id
        self.closed = False
        self._shares: dict[int, Any] = {}
        self._ends: list[Callable[[], Awaitable[None]]] = []

    def share(self, layer: object, make: Callable[[], T]) -> T:
        """``layer``'s state for this group, made by ``make`` at its first ask."""
        if id(layer) not in self._shares:
            self._shares[id(layer)] = make()
        return self._shares[id(layer)]  # type: ignore[no-any-return]

    def on_end(self, end: Callable[[], Awaitable[None]]) -> None:
        """Call ``end`` when the group's block is left (what a layer took and no create used)."""
        self._ends.append(end)


def current_group() -> CreateGroup | None:
    """The group the running create belongs to, if any (none once its block is left: a task that
    copied the context and runs on after it makes creates of its own)."""
    group = _GROUP.get()
    return None if group is None or group.closed else group


@contextlib.asynccontextmanager
async def create_group(size: int, timeout_s: float, parent_id: str | None = None) -> AsyncIterator[CreateGroup]:
    """A block whose creates are one group of ``size``; on the way out the group is closed, then each
    layer's ``on_end`` runs, shielded and bounded by ``timeout_s`` in all, a failure logged (never
    raised over the block's own)."""
    group = CreateGroup(size, parent_id)
    token = _GROUP.set(group)
    try:
        yield group
    finally:
        _GROUP.reset(token)
        group.closed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
            for end in group._ends:
                try:
                    await end()
                except Exception:
                    logger.warning("a layer could not give back what a create group took", exc_info=True)
