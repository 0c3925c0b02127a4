"""A streamed answer: the upstream's chat events passed on, converted to the client's dialect, as they come.

The upstream's stream is opened inside the call's span; each event is converted by the dialect (or
passed on as it came) and fed to the call's record, which is written before the stream's end goes
out. A failure once the stream has started is the dialect's error event; the upstream's stream is
closed and the call counted once, whether the events ran or not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from starlette.responses import Response

from .._errors import TokensError
from ..records import Custody
from ._chat import chunks_of
from ._errors import ProxyError, RequestRejectedError
from ._event_stream import EventStream
from ._intake import Turn
from ._records import StreamRecord
from ._telemetry import ProxyTelemetry

__all__ = ["serve_stream"]


async def serve_stream(
    telemetry: ProxyTelemetry,
    client_timeout: float,
    turn: Turn,
    chat: dict[str, Any],
    attributes: dict[str, Any],
    custody: Custody,
) -> Response:
    """The upstream's chat stream, opened, and answered event by event in the client's dialect."""
    dialect, upstream, body, history, call, started = turn
    span = telemetry.start_span(dialect, attributes)
    try:
        response = await upstream.chat_stream(chat, span)
    except (TokensError, httpx.HTTPError) as exc:
        error = telemetry.upstream_error(exc, dialect)
        await custody.end(error)
        telemetry.end_span(span, error)
        raise error from None

    closed = False

    async def close(error: ProxyError | None) -> None:
        """Once, whether the events ran or not: the upstream's stream closed, the call counted."""
        nonlocal closed
        if not closed:
            closed = True
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await response.aclose()
            telemetry.finished(dialect, True, started, error, span)

    async def gone() -> None:  # the client went away before the first event was produced
        await close(RequestRejectedError("the client went away before its stream started"))

    async def events() -> AsyncIterator[bytes]:
        error: ProxyError | None = None
        converter = dialect.events(body)
        gathered = StreamRecord() if custody.recorded else None
        try:
            if converter is not None:
                for event in converter.start():
                    yield event
            async for event in response.aiter_raw():
                if converter is None and gathered is None:
                    yield event
                    continue
                for chunk in chunks_of(event):
                    if chunk is None:
                        continue
                    if gathered is not None and gathered.feed(chunk):
                        await custody.write_chat(chat, gathered.completion())  # before the end goes out
                    if converter is not None:
                        for out in converter.feed(chunk):
                            yield out
                if converter is None:
                    yield event
            if converter is not None:
                for out in converter.finish():
                    yield out
                dialect.ended(converter, body, history, call.model_call_id)
        except (TokensError, httpx.HTTPError, ProxyError) as exc:
            error = telemetry.upstream_error(exc, dialect)
            await custody.end(error)
            yield dialect.error_event(error, converter)
        except anyio.get_cancelled_exc_class() as exc:  # cancelled before its record: the rollout has a hole
            await custody.end(exc)
            raise
        finally:
            await close(error)

    return EventStream(events(), client_timeout, call.headers, closing=gone)
