"""Whole answers: the upstream's reply recorded and answered whole, in the client's dialect.

A chat completion is converted by the dialect; vLLM's own answer (``/v1/responses``) gets its bundle
from the dialect too. The call's record is put before the answer goes out, as the chat completion
it was served as.
"""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from ._intake import Turn
from ._records import completion_of
from ._upstream import Reply

__all__ = ["serve_whole"]


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
