"""The answer: the upstream's reply recorded and answered in the client's dialect, whole or as a stream.

A whole chat completion is converted by the dialect; vLLM's own answer (``/v1/responses``) gets its
bundle from the dialect too. A streamed reply arrives opened, each event with the chunk its capture
decoded (decoded once); each chunk is converted by the dialect (or its event passed on as it came)
and the capture gathers the whole answer for the call's record, written when the chunk with the
bundles comes, before the stream's end goes out; so is the answer a later request continues (a
Responses ``previous_response_id``), so that a client may continue it at once, through any proxy
over the same store. The events made of one upstream event go on as one piece. A failure once the
stream has started is the dialect's error event, told in the turn's report; the upstream's stream is
closed once, whether the events ran or not. Either way the record is the chat completion the call
was served as.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import anyio
import httpx
from starlette.responses import JSONResponse, Response

from .._bundle import TokenBundle, TokenCompletion
from .._errors import TokensError
from .._stream import CapturedStream
from .._transport import STREAM_EXTENSION
from ..records import Custody
from ._chat import TOKEN_FIELDS
from ._dialects import Dialect, Events
from ._errors import ProxyError, RequestRejectedError, upstream_error
from ._event_stream import EventStream
from ._intake import Turn
from ._telemetry import Report
from ._upstream import Reply

__all__ = ["Relayed", "completion_of", "relay", "serve"]

SOURCE = "proxy"
"""The bundle's source as recorded (the capture chain cross-checked it; records do not keep sources)."""


def completion_of(response: Mapping[str, Any], fields: Mapping[str, Any]) -> TokenCompletion:
    """A chat completion (``response``, first choice) with the bundle ``fields`` as a ``TokenCompletion``."""
    prompt, generation, log_probs = (fields[name] for name in TOKEN_FIELDS)
    bundle = TokenBundle(prompt, generation, log_probs, SOURCE, fields.get("routed_experts"))
    return TokenCompletion(dict(response), (bundle,))


async def serve(turn: Turn, reply: Reply, client_timeout: float) -> Response:
    """The reply answered in the client's dialect: streamed event by event, or whole."""
    if reply.stream is None:
        return await serve_whole(turn, reply)
    return serve_stream(turn, reply, client_timeout)


async def serve_whole(turn: Turn, reply: Reply) -> Response:
    """The reply recorded (when the call is) and answered whole in the client's dialect."""
    dialect, body, history, call, custody = turn.dialect, turn.body, turn.history, turn.call, turn.custody
    assert reply.answer is not None  # a whole reply
    if reply.bundle is None:  # a chat completion, its bundle inline
        completion, fields = reply.answer, reply.answer["choices"][0]["message"]
    else:
        answer, completion, fields = dialect.native_answer(reply.answer, reply.bundle, body)
    if custody.recorded:
        await custody.write_chat(reply.chat, completion_of(completion, fields))
    if reply.bundle is None:
        answer = dialect.answer(completion, body, history, call.model_call_id)
    await dialect.remember(body, answer, history, call.model_call_id)
    return JSONResponse(answer, headers=call.headers)


def serve_stream(turn: Turn, reply: Reply, client_timeout: float) -> Response:
    """The reply's chat stream answered event by event in the client's dialect."""
    dialect, body, custody = turn.dialect, turn.body, turn.custody
    assert reply.stream is not None  # a streamed reply
    captured: CapturedStream = reply.stream.extensions[STREAM_EXTENSION]

    async def ended(converter: Events) -> None:  # the answer kept before its end goes out: a client may
        await dialect.ended(converter, body, turn.history, turn.call.model_call_id)  # continue it at once, anywhere

    return relay(
        reply.stream,
        captured,
        partial(custody.write_chat, reply.chat),
        Relayed(custody, turn.report, turn.call.headers, dialect, dialect.events(body), ended),
        client_timeout,
    )


class Relayed(NamedTuple):
    """Whom a relayed stream answers: the call's custody and report, the answer's headers, the
    client's dialect and its events made from the chunks (None: the chunks pass on as they came;
    ``ended`` runs before the last of them goes out)."""

    custody: Custody
    report: Report
    headers: Mapping[str, str]
    dialect: Dialect
    converter: Events | None = None
    ended: Callable[[Events], Awaitable[None]] | None = None


def relay(
    response: httpx.Response,
    captured: CapturedStream,
    write: Callable[[TokenCompletion], Awaitable[None]],
    to: Relayed,
    client_timeout: float,
) -> Response:
    """A captured stream answered event by event: each chunk converted (or passed on), the record
    written (``write``) when the chunk with the bundles comes, before the end goes out; a failure the
    dialect's error event; the upstream's ``response`` closed once, whether the events ran or not."""
    custody, report, converter = to.custody, to.report, to.converter
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
        try:
            if converter is not None:
                yield b"".join(converter.start())
            async for event, chunk in captured.events():  # each chunk as the capture decoded it
                if chunk is not None:
                    if custody.recorded and "token_bundles" in chunk and captured.completion is not None:
                        await write(captured.completion)  # before the end goes out
                    if converter is not None and (converted := converter.feed(chunk)):
                        yield b"".join(converted)
                if converter is None:
                    yield event
            if converter is not None:
                closing = converter.finish()
                if to.ended is not None:
                    await to.ended(converter)
                yield b"".join(closing)
        except (TokensError, httpx.HTTPError, ProxyError) as exc:
            report.error, report.cause = upstream_error(exc), exc
            await custody.end(report.error)
            yield to.dialect.error_event(report.error, converter)
        except anyio.get_cancelled_exc_class() as exc:  # cancelled before its record: the rollout has a hole
            await custody.end(exc)
            raise
        finally:
            await close()

    return EventStream(events(), client_timeout, to.headers, closing=gone)
