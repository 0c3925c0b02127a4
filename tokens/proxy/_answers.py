"""Whole answers: the upstream asked once, the call recorded, the answer given whole in the client's dialect.

``serve_whole`` asks for a chat completion with inline ids and converts it to the client's
dialect; ``serve_native`` asks vLLM's own ``/v1/responses`` (raw message tokens, captured by the
chain) for a dialect it serves itself, or answers None when the upstream does not serve it. Both
record the call before the answer is given, inside the call's span.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import msgspec
from starlette.responses import JSONResponse, Response

from .._errors import TokensError
from .._exchange import Exchange, Handler
from .._vllm_responses import TOKEN_FIELDS, decode_responses, prepare_responses_request
from ..records import Custody
from ._intake import Turn
from ._records import Recorder, completion_of
from ._telemetry import DIALECT_ATTR, STREAM_ATTR, UPSTREAM_ATTR, ProxyTelemetry

__all__ = ["serve_native", "serve_whole"]

_DECODE = msgspec.json.Decoder(dict[str, Any])


async def serve_whole(
    telemetry: ProxyTelemetry, turn: Turn, chat: dict[str, Any], attributes: dict[str, Any], custody: Custody
) -> Response:
    """A chat completion asked whole, recorded, and answered whole in the client's dialect."""
    dialect, upstream, body, history, call, started = turn
    async with custody:
        with telemetry.span(attributes) as span:
            try:
                data = await upstream.chat(chat)
            except (TokensError, httpx.HTTPError) as exc:
                raise telemetry.upstream_error(exc, dialect) from None
            completion = _DECODE.decode(data)
            if custody.recorded:
                await custody.write_chat(chat, completion_of(completion, completion["choices"][0]["message"]))
            answer = dialect.answer(completion, body, history, call.model_call_id)
            telemetry.finished(dialect, False, started, None, span)
    return JSONResponse(answer, headers=call.headers)


async def serve_native(
    telemetry: ProxyTelemetry,
    chain: Handler,
    recorder: Recorder,
    fall_back: bool,
    turn: Turn,
) -> Response | None:
    """A Responses request through vLLM's ``/v1/responses``; None when the upstream does not serve it."""
    dialect, upstream, body, history, call, started = turn
    sent = prepare_responses_request({key: value for key, value in body.items() if key != "previous_response_id"})
    sent["input"] = (
        [*history, *sent["input"]]
        if isinstance(sent.get("input"), list)
        else ([*history, {"type": "message", "role": "user", "content": sent.get("input", "")}])
    )
    attributes = {DIALECT_ATTR: dialect.name, STREAM_ATTR: False, UPSTREAM_ATTR: "responses"}
    chat = dialect.to_chat(body, history) if recorder.records(call.coordinates) else {}
    async with recorder.custody(call.coordinates, chat) as custody:
        with telemetry.span(attributes) as span:
            try:
                data = await upstream.responses(sent, fall_back=fall_back)
                if data is None:
                    return None
                decoded = decode_responses(data)
                bundle = await chain(Exchange(sent, decoded))
            except (TokensError, httpx.HTTPError) as exc:
                raise telemetry.upstream_error(exc, dialect) from None
            upstream.serves_responses = True
            answer = decoded.answer
            answer.pop("choices", None)
            output = answer["output"]
            if not output:
                output.append(
                    {
                        "id": f"msg_{answer.get('id', '')}",
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [],
                    }
                )
            output[-1].update(
                zip(
                    TOKEN_FIELDS,
                    (bundle.prompt_token_ids, bundle.generation_token_ids, bundle.generation_log_probs),
                    strict=True,
                )
            )
            answer["previous_response_id"] = body.get("previous_response_id")
            if custody.recorded:
                message = {"role": "assistant", "content": _output_text(output)}
                as_chat = {"id": answer.get("id"), "model": answer.get("model"), "choices": [{"message": message}]}
                await custody.write_chat(chat, completion_of(as_chat, output[-1]))
            dialect.remember(body, answer, history, call.model_call_id)
            telemetry.finished(dialect, False, started, None, span)
    return JSONResponse(answer, headers=call.headers)


def _output_text(output: Sequence[Any]) -> str:
    messages = [item for item in output if isinstance(item, dict) and item.get("type") == "message"]
    parts = [part for item in messages for part in item.get("content") or () if isinstance(part, dict)]
    return "".join(str(part.get("text", "")) for part in parts if part.get("type") == "output_text")
