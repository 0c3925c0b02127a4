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
from ._chat import sse
from ._errors import ProxyError, anthropic_error_body, openai_error_body
from ._messages import MessagesEvents, chat_to_messages, messages_to_chat
from ._previous import PreviousResponses
from ._responses import (
    ResponsesEvents,
    chat_to_responses,
    error_event,
    history_of,
    native_answer,
    native_request,
    responses_to_chat,
)

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

    def history(self, body: Mapping[str, Any]) -> tuple[list[Any], str | None]:
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
        return body

    def answer(
        self, completion: dict[str, Any], body: Mapping[str, Any], history: list[Any], call_id: str
    ) -> dict[str, Any]:
        return completion

    def remember(self, body: Mapping[str, Any], answer: Mapping[str, Any], history: list[Any], call_id: str) -> None:
        """Keep ``answer`` for later requests that continue it (only Responses answers are kept)."""

    def events(self, body: Mapping[str, Any]) -> Events | None:
        return None

    def ended(self, events: Events | None, body: Mapping[str, Any], history: list[Any], call_id: str) -> None:
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
    ``previous_response_id`` (in ``previous``, bounded in entries and bytes)."""

    name = "responses"

    def __init__(self, previous: PreviousResponses) -> None:
        self.previous = previous

    def history(self, body: Mapping[str, Any]) -> tuple[list[Any], str | None]:
        response_id = body.get("previous_response_id")
        if not isinstance(response_id, str):
            return [], None
        return self.previous.get(response_id)

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

    def answer(
        self, completion: dict[str, Any], body: Mapping[str, Any], history: list[Any], call_id: str
    ) -> dict[str, Any]:
        answer = chat_to_responses(completion, body, f"resp_{secrets.token_hex(12)}")
        self.remember(body, answer, history, call_id)
        return answer

    def remember(self, body: Mapping[str, Any], answer: Mapping[str, Any], history: list[Any], call_id: str) -> None:
        """Keep ``answer`` for a later ``previous_response_id`` (unless the request said ``store: false``)."""
        if body.get("store", True) is not False:
            earlier = body.get("previous_response_id")
            self.previous.put(
                answer["id"], history_of(body, answer), earlier if isinstance(earlier, str) else None, call_id
            )

    def events(self, body: Mapping[str, Any]) -> Events:
        return ResponsesEvents(body, f"resp_{secrets.token_hex(12)}")

    def ended(self, events: Events | None, body: Mapping[str, Any], history: list[Any], call_id: str) -> None:
        if isinstance(events, ResponsesEvents) and events.completed is not None:
            self.remember(body, events.completed, history, call_id)

    def error_event(self, error: ProxyError, events: Events | None) -> bytes:
        return events.error(error) if events is not None else error_event(error, 0)


CHAT = Dialect()
"""The dialect of answers to no dialect's path (a 404, ``GET /v1/models``)."""


def dialects(previous: PreviousResponses) -> dict[str, Dialect]:
    """The served paths (under ``/v1/``) and their dialects; ``previous``: the Responses answers kept."""
    return {"chat/completions": CHAT, "responses": _Responses(previous), "messages": _Messages()}
