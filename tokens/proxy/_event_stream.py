"""``EventStream``: the proxy's server-sent event answer, written as the events are produced, bounded
in memory and in how long a client may take to read each write."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStream"]


class EventStream(Response):
    """A server-sent event stream sent as it is produced: each event written within ``send_timeout``
    (a client that stops reading is dropped), the producer closed when the client goes away.
    ``closing`` is awaited last, shielded, in every case: the cleanup of a producer that never ran
    (its ``finally`` does not run when the client is gone before the first event)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        send_timeout: float,
        headers: Mapping[str, str],
        *,
        closing: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.send_timeout = send_timeout
        self.closing = closing
        self.status_code = 200
        self.background = None
        fields = {
            **headers,
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
        }
        self.raw_headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in fields.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self.events
        ready, taken = anyio.create_memory_object_stream[bytes](_BATCH)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with anyio.create_task_group() as group:

                async def disconnected() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                async def produce() -> None:
                    async with ready:
                        async for event in events:
                            try:  # without a checkpoint: the events of one upstream read travel together
                                ready.send_nowait(event)
                            except anyio.WouldBlock:
                                await ready.send(event)

                group.start_soon(disconnected)
                group.start_soon(produce)
                with anyio.CancelScope() as stalled:  # its deadline is set while a write is under way
                    async with taken:
                        async for event in taken:  # what is ready now goes in one write; nothing waits for more
                            batch = [event]
                            while len(batch) < _BATCH:
                                try:
                                    batch.append(taken.receive_nowait())
                                except (anyio.WouldBlock, anyio.EndOfStream):
                                    break
                            stalled.deadline = anyio.current_time() + self.send_timeout
                            await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})
                            stalled.deadline = math.inf
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()  # done, or the client stopped reading: nothing more to send it
        except OSError:
            pass  # the client went away
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
                if self.closing is not None:
                    await self.closing()


_BATCH = 64
"""Events held between the upstream and the client at most (bounded memory), and sent in one write."""
