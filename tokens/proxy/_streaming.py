"""A streamed answer: the upstream's chat events passed on, converted to the client's dialect, as they come.

The upstream's stream arrives opened, each event with the chunk its capture decoded (decoded once);
each chunk is converted by the dialect (or its event passed on as it came) and fed to the call's
record, which is written before the stream's end goes out; so is the answer a later request
continues (a Responses ``previous_response_id``), so that a client may continue it at once, through
any proxy over the same store. The events made of one upstream event go on as one piece. A failure
once the stream has started is the dialect's error event, told in the turn's report; the upstream's
stream is closed once, whether the events ran or not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
from starlette.responses import Response

from .._errors import TokensError
from .._stream import CapturedStream
from .._transport import STREAM_EXTENSION
from ._errors import ProxyError, RequestRejectedError, upstream_error
from ._event_stream import EventStream
from ._intake import Turn
from ._records import StreamRecord
from ._upstream import Reply

__all__ = ["serve_stream"]


def serve_stream(turn: Turn, reply: Reply, client_timeout: float) -> Response:
    """The reply's chat stream answered event by event in the client's dialect."""
    dialect, body, custody, report = turn.dialect, turn.body, turn.custody, turn.report
    response, chat = reply.stream, reply.chat
    assert response is not None  # a streamed reply
    captured: CapturedStream = response.extensions[STREAM_EXTENSION]
    closed = False

    async def close() -> None:
        """Once, whether the events ran or not: the upstream's stream closed."""
        nonlocal closed
        if not closed:
            closed = True
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await response.aclose()

    async def gone() -> None:  # the client went away before the first event was produced
        if not closed:
            report.error = RequestRejectedError("the client went away before its stream started")
        await close()

    async def events() -> AsyncIterator[bytes]:
        converter = dialect.events(body)
        gathered = StreamRecord() if custody.recorded else None
        try:
            if converter is not None:
                yield b"".join(converter.start())
            async for event, chunk in captured.events():  # each chunk as the capture decoded it
                if chunk is not None:
                    if gathered is not None and gathered.feed(chunk):
                        await custody.write_chat(chat, gathered.completion())  # before the end goes out
                    if converter is not None and (converted := converter.feed(chunk)):
                        yield b"".join(converted)
                if converter is None:
                    yield event
            if converter is not None:
                closing = converter.finish()  # the answer kept before its end goes out: a client may continue
                await dialect.ended(converter, body, turn.history, turn.call.model_call_id)  # it at once, anywhere
                yield b"".join(closing)
        except (TokensError, httpx.HTTPError, ProxyError) as exc:
            report.error, report.cause = upstream_error(exc), exc
            await custody.end(report.error)
            yield dialect.error_event(report.error, converter)
        except anyio.get_cancelled_exc_class() as exc:  # cancelled before its record: the rollout has a hole
            await custody.end(exc)
            raise
        finally:
            await close()

    return EventStream(events(), client_timeout, turn.call.headers, closing=gone)
