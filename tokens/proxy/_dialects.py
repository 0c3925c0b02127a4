"""The proxy's three dialects, and everything in which they differ.

A ``Dialect`` turns its request into the chat completion the upstream serves with exact ids
(``to_chat``, with the ``history`` a Responses ``previous_response_id`` stands for), the chat
completion back into its own answer (``answer``), the upstream's chat stream into its own events
(``events``: None when they pass on as the upstream sent them), and a failure into its own error
shape, as a JSON body (``error_body``) and as a stream's event (``error_event``). A dialect that
vLLM serves itself with exact ids (Responses, through ``/v1/responses``) gives the request it asks
there (``native_request``) and makes its answer from vLLM's (``native_answer``). ``dialects()`` maps
each served path to its dialect; nothing outside this module tells one dialect from another.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from .._bundle import TokenBundle
from ._chat import sse, without_echoes
from ._errors import ProxyError, anthropic_error_body, openai_error_body
from ._history import ResponseHistory
from ._messages import MessagesEvents, chat_to_messages, messages_to_chat
from ._messages import dropped_tools as messages_dropped
from ._responses import (
    ResponsesEvents,
    chat_to_responses,
    error_event,
    history_of,
    native_answer,
    native_request,
    responses_to_chat,
)
from ._responses import dropped_tools as responses_dropped

__all__ = ["Dialect", "Events", "dialects"]


class Events(Protocol):
    """A dialect's stream made from the upstream's chat chunks: each step returns the SSE bytes to send."""

    def start(self) -> list[bytes]: ...
    def feed(self, chunk: Mapping[str, Any]) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...
    def error(self, error: ProxyError) -> bytes: ...


class Dialect:
    """Chat completions, the upstream's own dialect: requests, answers and events pass as they are."""

    name: ClassVar[str] = "chat"
    """The dialect's name in telemetry (``tokens.proxy.dialect``) and logs."""

    async def history(self, body: Mapping[str, Any]) -> tuple[list[Any], str | None]:
        """The earlier items the request continues and the model call id that answered them."""
        return [], None

    def native_request(
        self, body: Mapping[str, Any], history: list[Any], responses_upstream: str
    ) -> dict[str, Any] | None:
        """The request as vLLM's own API for the dialect takes it, with exact ids asked; None when it
        is asked as a chat completion (``responses_upstream``: the proxy's choice, ``create_app``'s)."""
        return None

    def native_answer(
        self, answer: dict[str, Any], bundle: TokenBundle, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], Mapping[str, Any]]:
        """vLLM's own answer to ``native_request`` with the ``bundle`` on it, the chat completion it is
        recorded as, and the bundle's fields as the record takes them."""
        raise NotImplementedError(f"the {self.name} dialect is not served natively")

    def to_chat(self, body: dict[str, Any], history: list[Any]) -> dict[str, Any]:
        return without_echoes(body)

    def dropped(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """What ``to_chat`` leaves out of the request, each ``{"where", "type", "reason"}`` (recorded)."""
        return []

    def answer(
        self, completion: dict[str, Any], body: Mapping[str, Any], history: list[Any], call_id: str
    ) -> dict[str, Any]:
        return completion

    async def remember(
        self, body: Mapping[str, Any], answer: Mapping[str, Any], history: list[Any], call_id: str
    ) -> None:
        """Keep ``answer`` for later requests that continue it (only Responses answers are kept)."""

    async def kept(self, answer_id: str) -> dict[str, Any]:
        """An answer kept by ``remember`` (without its bundle); ``ProxyError`` (404) for one not kept."""
        raise ProxyError(f"the {self.name} dialect keeps no answers to retrieve", status=404)

    def events(self, body: Mapping[str, Any]) -> Events | None:
        return None

    async def ended(self, events: Events | None, body: Mapping[str, Any], history: list[Any], call_id: str) -> None:
        """A stream's answer went out whole."""

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return openai_error_body(error)

    def error_event(self, error: ProxyError, events: Events | None) -> bytes:
        return sse(openai_error_body(error))


class _Messages(Dialect):
    """Anthropic's Messages API."""

    name = "messages"

    def to_chat(self, body: dict[str, Any], history: list[Any]) -> dict[str, Any]:
        return messages_to_chat(body)

    def dropped(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        return messages_dropped(body)

    def answer(
        self, completion: dict[str, Any], body: Mapping[str, Any], history: list[Any], call_id: str
    ) -> dict[str, Any]:
        return chat_to_messages(completion)

    def events(self, body: Mapping[str, Any]) -> Events:
        return MessagesEvents()

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        return anthropic_error_body(error)

    def error_event(self, error: ProxyError, events: Events | None) -> bytes:
        return sse(anthropic_error_body(error), "error")


class _Responses(Dialect):
    """OpenAI's Responses API: served by vLLM itself where it can (``native``), its answers kept for
    ``previous_response_id`` (in ``previous``: this process's memory, bounded in entries and bytes,
    or the record store)."""

    name = "responses"

    def __init__(self, previous: ResponseHistory) -> None:
        self.previous = previous

    async def history(self, body: Mapping[str, Any]) -> tuple[list[Any], str | None]:
        response_id = body.get("previous_response_id")
        if not isinstance(response_id, str):
            return [], None
        return await self.previous.get(response_id)

    async def kept(self, answer_id: str) -> dict[str, Any]:
        return await self.previous.answer(answer_id)

    def native_request(
        self, body: Mapping[str, Any], history: list[Any], responses_upstream: str
    ) -> dict[str, Any] | None:
        """``/v1/responses`` is asked unless the proxy converts (``"chat"``), and in ``"auto"`` only for a
        request without tools and not streamed (vLLM has no log probabilities for tool calls there)."""
        if responses_upstream == "chat" or (responses_upstream == "auto" and (body.get("tools") or body.get("stream"))):
            return None
        return native_request(body, history)

    def native_answer(
        self, answer: dict[str, Any], bundle: TokenBundle, body: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], Mapping[str, Any]]:
        return native_answer(answer, bundle, body)

    def to_chat(self, body: dict[str, Any], history: list[Any]) -> dict[str, Any]:
        return responses_to_chat(body, history)

    def dropped(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        return responses_dropped(body)

    def answer(
        self, completion: dict[str, Any], body: Mapping[str, Any], history: list[Any], call_id: str
    ) -> dict[str, Any]:
        return chat_to_responses(completion, body, f"resp_{secrets.token_hex(12)}")

    async def remember(
        self, body: Mapping[str, Any], answer: Mapping[str, Any], history: list[Any], call_id: str
    ) -> None:
        """Keep ``answer``'s turn (the request's input and the answer's output) for a later
        ``previous_response_id`` (unless the request said ``store: false``)."""
        if body.get("store", True) is not False:
            earlier = body.get("previous_response_id")
            turn = history_of(body, answer)
            outputs = len(answer.get("output", ()))  # the answer kept (for GET /v1/responses/{id}) without its bundle
            kept = {**answer, "output": turn[len(turn) - outputs :]}
            await self.previous.put(answer["id"], turn, earlier if isinstance(earlier, str) else None, call_id, kept)

    def events(self, body: Mapping[str, Any]) -> Events:
        return ResponsesEvents(body, f"resp_{secrets.token_hex(12)}")

    async def ended(self, events: Events | None, body: Mapping[str, Any], history: list[Any], call_id: str) -> None:
        if isinstance(events, ResponsesEvents) and events.completed is not None:
            await self.remember(body, events.completed, history, call_id)

    def error_event(self, error: ProxyError, events: Events | None) -> bytes:
        return events.error(error) if events is not None else error_event(error, 0)


CHAT = Dialect()
"""The dialect of answers to no dialect's path (a 404, ``GET /v1/models``)."""


def dialects(previous: ResponseHistory) -> dict[str, Dialect]:
    """The served paths (under ``/v1/``) and their dialects; ``previous``: where Responses turns are kept."""
    return {"chat/completions": CHAT, "responses": _Responses(previous), "messages": _Messages()}
