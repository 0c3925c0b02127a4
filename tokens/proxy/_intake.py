"""A request's way in: read, checked and made the ``Turn`` the later stages serve.

The rollout a request names is checked first (its id, and its token when the proxy holds a
rollout key), then the request takes its place (``_limits``), and only then is its body read,
within ``max_request_bytes`` and ``client_timeout`` (``enter``: the side routes' way in too); the
call's ids come from the URL's rollout id and the ``X-Rollout-Id``, ``X-Model-Call-Id``,
``X-Parent-Call-Id`` and ``X-Weight-Version`` headers, each checked as the records check it (and
its affinity, the replica key: ``X-Session-Id``, else the rollout id, else the call id); the
dialect gives the history
it continues, the request it asks of vLLM itself (if any) and the chat completion it is served or
recorded as. Every refusal is a typed ``ProxyError``, before anything goes upstream. The call
carries the headers every answer gives back.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request

from ..records import CoordinateError, Coordinates, Custody
from ..records._coordinates import check_id, check_weight_version
from ._affinity import SESSION_HEADER
from ._credentials import TOKEN_HEADER, RolloutKey
from ._dialects import Dialect
from ._errors import ClientTimeoutError, RequestRejectedError, RequestTooLargeError
from ._limits import Admission
from ._records import Recorder
from ._telemetry import Report

__all__ = ["Call", "Intake", "Turn", "call_of", "read_json", "rollout_id_of"]

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
    is recorded, the headers its answer carries (its call id and, when recorded, its rollout id), and
    the key its upstream replica is chosen by (``affinity``)."""

    model_call_id: str
    coordinates: Coordinates | None
    headers: dict[str, str]
    affinity: str = ""


class Turn(NamedTuple):
    """A request as the stages that serve it see it: its dialect, its body and the history it
    continues, whether it streams, its call and the call's custody; what it asks of vLLM's own API
    (``native``; None: it is asked as a chat completion) and the chat completion it is served or
    recorded as (``chat``; None for a native call that is not recorded); the ``report`` its stages fill."""

    dialect: Dialect
    body: dict[str, Any]
    history: list[Any]
    stream: bool
    call: Call
    custody: Custody
    native: dict[str, Any] | None
    chat: dict[str, Any] | None
    report: Report


@dataclass(frozen=True, eq=False)  # eq=False: one proxy's intake, equal to itself only
class Intake:
    """How requests come in: the limits a body is read within, how Responses requests are asked
    (``responses_upstream``, ``create_app``'s), and the records a call is kept in."""

    max_request_bytes: int
    client_timeout: float
    responses_upstream: str
    recorder: Recorder
    admission: Admission
    rollout_key: RolloutKey | None = None

    async def turn_of(self, request: Request, dialect: Dialect, report: Report, place: AsyncExitStack) -> Turn:
        """The request read and checked, as the ``Turn`` the stages serve (nothing is sent yet). First the
        rollout it names, its token checked when the proxy holds a rollout key, then its place (held in
        ``place``, which the caller keeps to the answer's last byte), before its body is read."""
        await self.enter(request, place)
        body = await read_json(request, self.max_request_bytes, self.client_timeout)
        report.stream = stream = bool(body.get("stream"))
        call = call_of(request)
        history, parent = await dialect.history(body)
        native = dialect.native_request(body, history, self.responses_upstream)
        if parent is not None and call.coordinates is not None and call.coordinates.parent_call_id is None:
            call = dataclasses.replace(call, coordinates=dataclasses.replace(call.coordinates, parent_call_id=parent))
        custody = self.recorder.custody(call.coordinates, dialect.dropped(body))
        chat = dialect.to_chat(body, history) if native is None or custody.recorded else None
        n = None if chat is None else chat.get("n")
        if custody.recorded and n is not None and n != 1:
            raise RequestRejectedError(f"n={n!r} with a rollout id: a record holds one choice; send n=1", param="n")
        return Turn(dialect, body, history, stream, call, custody, native, chat, report)

    async def enter(self, request: Request, place: AsyncExitStack | None) -> None:
        """The rollout ``request`` names (if any) checked, its token too when the proxy holds a rollout
        key; then, unless ``place`` is None (a route that asks nothing of an upstream), a place taken
        for it in the proxy and its rollout, held in ``place``."""
        rollout_id = rollout_id_of(request)
        if rollout_id is not None and self.rollout_key is not None:
            self.rollout_key.check(rollout_id, request.path_params.get("token") or request.headers.get(TOKEN_HEADER))
        if place is not None:
            await place.enter_async_context(self.admission.admit(rollout_id))


async def read_json(request: Request, max_request_bytes: int, client_timeout: float) -> dict[str, Any]:
    """The request's body as a JSON object, read whole within ``max_request_bytes`` and ``client_timeout``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_request_bytes:
        raise RequestTooLargeError(_too_large(max_request_bytes, f"it declares {int(declared):,} bytes"))
    data = bytearray()  # grown in place: the body is held once, not as parts and their join
    try:
        with anyio.fail_after(client_timeout):
            async for part in request.stream():
                if len(data) + len(part) > max_request_bytes:
                    raise RequestTooLargeError(_too_large(max_request_bytes, "the body is larger"))
                data += part
    except TimeoutError:
        raise ClientTimeoutError(
            f"the request body did not arrive within client_timeout={client_timeout:g} s; send it whole"
        ) from None
    except ClientDisconnect:
        raise RequestRejectedError("the client went away before its request body was complete") from None
    try:
        return _DECODE.decode(data)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise RequestRejectedError(f"the request body is not a JSON object ({str(exc)[:200]})") from None


def _too_large(max_request_bytes: int, detail: str) -> str:
    return f"the request body is over the proxy's max_request_bytes={max_request_bytes:,} ({detail})"


def rollout_id_of(request: Request) -> str | None:
    """The rollout the request names: the URL's (``/r/<rollout-id>/...``), else ``X-Rollout-Id``'s."""
    return _coordinate(request.path_params.get("rollout"), "the URL's rollout id", check_id) or _coordinate(
        request.headers.get(ROLLOUT_HEADER), "X-Rollout-Id", check_id
    )


def call_of(request: Request) -> Call:
    """The request's call: its ids from the URL and headers, a fresh call id when it names none."""
    headers = request.headers
    rollout_id = rollout_id_of(request)
    call_id = _coordinate(headers.get(CALL_HEADER), "X-Model-Call-Id", check_id) or f"call_{secrets.token_hex(12)}"
    parent = _coordinate(headers.get(PARENT_HEADER), "X-Parent-Call-Id", check_id)
    weight = _coordinate(headers.get(WEIGHT_HEADER), "X-Weight-Version", check_weight_version)
    coordinates = None if rollout_id is None else Coordinates(rollout_id, call_id, parent, weight)
    answered = {CALL_HEADER: call_id} if rollout_id is None else {CALL_HEADER: call_id, ROLLOUT_HEADER: rollout_id}
    return Call(call_id, coordinates, answered, headers.get(SESSION_HEADER) or rollout_id or call_id)


def _coordinate(value: str | None, where: str, check: Callable[[Any, str], str]) -> str | None:
    """A header's (or the URL's) value, None when absent; ``RequestRejectedError`` naming ``where``
    when ``check`` refuses it."""
    if value is None or value == "":
        return None
    try:
        return check(value, where)
    except CoordinateError as exc:
        raise RequestRejectedError(str(exc), param=where) from None
