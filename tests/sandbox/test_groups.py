"""``create_group``: the creates of its block find the group, and a task that outlives the block does not."""

from __future__ import annotations

import contextvars

import pytest

from sandbox_middleware._groups import create_group, current_group

pytestmark = pytest.mark.anyio


async def test_a_context_copied_in_a_group_has_no_group_once_the_block_is_left() -> None:
    """A task started in the block (it copies the context) and running on after it makes creates of
    its own: a layer would otherwise take the group's slots for it, after the group gave back its own."""
    ended: list[bool] = []
    async with create_group(3, 1.0, "parent") as group:
        copied = contextvars.copy_context()
        assert current_group() is group and copied.run(current_group) is group
        group.on_end(lambda: _record(ended, group.closed))
    assert copied.run(current_group) is None and current_group() is None
    assert ended == [True]  # closed before the layers' ends run


async def _record(ended: list[bool], closed: bool) -> None:
    ended.append(closed)
