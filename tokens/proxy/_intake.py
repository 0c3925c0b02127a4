"""A request's way in: its body read whole (bounded in size and time) and its call's coordinates.

The body is read with ``max_request_bytes`` and ``client_timeout``; the call's ids come from the
URL's rollout id and the ``X-Rollout-Id``, ``X-Model-Call-Id``, ``X-Parent-Call-Id`` and
``X-Weight-Version`` headers, each checked as the records check it. Every refusal is a typed
``ProxyError``. The call carries the headers every answer gives back.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request

from ..records import CoordinateError, Coordinates
from ..records._coordinates import check_id, check_weight_version
from ._dialects import Dialect
from ._errors import ClientTimeoutError, RequestRejectedError, RequestTooLargeError
from ._upstream import Upstream

__all__ = ["Call", "Turn", "call_of", "read_json"]

ROLLOUT_HEADER, CALL_HEADER, PARENT_HEADER, WEIGHT_HEADER = (
    "x-rollout-id",
    "x-model-call-id",
    "x-parent-call-id",
    "x-weight-version",
)
_DECODE = msgspec.json.Decoder(dict[str, Any])


@dataclass(frozen=True)
class Call:
    """One request's call: its id (always answered in ``X-Model-Call-Id``), with a rollout id where it
    is recorded, and the headers its answer carries (its call id and, when recorded, its rollout id)."""

    model_call_id: str
    coordinates: Coordinates | None
    headers: dict[str, str]


class Turn(NamedTuple):
    """A request as the stages that serve it see it: its dialect and upstream, its body and the history
    it continues, its call, and when it came in (``time.perf_counter``)."""

    dialect: Dialect
    upstream: Upstream
    body: dict[str, Any]
    history: list[Any]
    call: Call
    started: float


async def read_json(request: Request, max_request_bytes: int, client_timeout: float) -> dict[str, Any]:
    """The request's body as a JSON object, read whole within ``max_request_bytes`` and ``client_timeout``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
        raise RequestTooLargeError(_too_large(max_request_bytes, f"it declares {int(declared):,} bytes"))
    parts: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(client_timeout):
            async for part in request.stream():
                size += len(part)
                if size > max_request_bytes:
                    raise RequestTooLargeError(_too_large(max_request_bytes, "the body is larger"))
                parts.append(part)
    except TimeoutError:
        raise ClientTimeoutError(
            f"the request body did not arrive within client_timeout={client_timeout:g} s; send it whole"
        ) from None
    except ClientDisconnect:
        raise RequestRejectedError("the client went away before its request body was complete") from None
    try:
        return _DECODE.decode(b"".join(parts))
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise RequestRejectedError(f"the request body is not a JSON object ({str(exc)[:200]})") from None


def _too_large(max_request_bytes: int, detail: str) -> str:
    return f"the request body is over the proxy's max_request_bytes={max_request_bytes:,} ({detail})"


def call_of(request: Request, rollout: str | None) -> Call:
    """The request's call: its ids from the URL and headers, a fresh call id when it names none."""
    headers = request.headers
    rollout_id = _coordinate(rollout, "the URL's rollout id", check_id) or _coordinate(
        headers.get(ROLLOUT_HEADER), "X-Rollout-Id", check_id
    )
    call_id = _coordinate(headers.get(CALL_HEADER), "X-Model-Call-Id", check_id) or f"call_{secrets.token_hex(12)}"
    parent = _coordinate(headers.get(PARENT_HEADER), "X-Parent-Call-Id", check_id)
    weight = _coordinate(headers.get(WEIGHT_HEADER), "X-Weight-Version", check_weight_version)
    coordinates = None if rollout_id is None else Coordinates(rollout_id, call_id, parent, weight)
    answered = {CALL_HEADER: call_id} if rollout_id is None else {CALL_HEADER: call_id, ROLLOUT_HEADER: rollout_id}
    return Call(call_id, coordinates, answered)


def _coordinate(value: str | None, where: str, check: Callable[[Any, str], str]) -> str | None:
    """A header's (or the URL's) value, None when absent; ``RequestRejectedError`` naming ``where``
    when ``check`` refuses it."""
    if value is None or value == "":
        return None
    try:
        return check(value, where)
    except CoordinateError as exc:
        raise RequestRejectedError(str(exc), param=where) from None
