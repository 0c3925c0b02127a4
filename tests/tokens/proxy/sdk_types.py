"""The official SDKs' own pydantic types for what the proxy sends, validated strictly
(``model_validate(strict=True)``): each answer by its dialect's type, each streamed event by the type
its ``type`` names; and a recorder of everything an app sent, for checking a real agent's traffic."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage


def _by_type(union: Any) -> dict[str, type[BaseModel]]:
    """The members of a discriminated union of events, by their ``type`` literal."""
    members = typing.get_args(typing.get_args(union)[0] if typing.get_origin(union) is typing.Annotated else union)
    return {typing.get_args(member.model_fields["type"].annotation)[0]: member for member in members}


RESPONSES_EVENTS = _by_type(ResponseStreamEvent)
MESSAGES_EVENTS = {**_by_type(RawMessageStreamEvent), "error": ErrorResponse}
ANSWERS: dict[str, type[BaseModel]] = {"responses": Response, "messages": Message, "chat/completions": ChatCompletion}


def strict(model: type[BaseModel], data: Any) -> BaseModel:
    return model.model_validate(data, strict=True)


def sse_events(data: bytes) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """A stream's events: each ``event:`` name (None without) and its JSON data."""
    name = None
    for line in data.decode().splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: {"):
            yield name, json.loads(line[6:])
            name = None


def check_sent(path: str, content_type: str, body: bytes) -> int:
    """Validate what the proxy answered to a model call at ``path`` (ending in its dialect's route);
    the number of answers and events checked."""
    dialect = next(name for name in ANSWERS if path.endswith("/v1/" + name))
    if not content_type.startswith("text/event-stream"):
        strict(ANSWERS[dialect], json.loads(body))
        return 1
    checked = 0
    for name, data in sse_events(body):
        if dialect == "responses":
            strict(RESPONSES_EVENTS[data["type"]], data)
        elif dialect == "messages":
            assert name == data["type"], (name, data["type"])
            strict(MESSAGES_EVENTS[data["type"]], data)
        else:
            strict(ChatCompletionChunk, data)
        checked += 1
    return checked


@dataclass
class Recording:
    """An ASGI app that passes everything to ``app`` and keeps each model call's answer as sent."""

    app: ASGIApp
    sent: list[tuple[str, int, str, bytes]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head: dict[str, Any] = {}
        parts: list[bytes] = []

        async def keep(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                head["status"] = message["status"]
                head["type"] = dict(message.get("headers") or []).get(b"content-type", b"").decode()
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, keep)
        self.sent.append((scope["path"], head.get("status", 0), head.get("type", ""), b"".join(parts)))

    def check(self) -> int:
        """Every model call answered 200 validated strictly; the number of answers and events checked."""
        calls = [entry for entry in self.sent if any(entry[0].endswith("/v1/" + name) for name in ANSWERS)]
        assert calls and all(status == 200 for _, status, _, _ in calls), [(p, s) for p, s, _, _ in self.sent]
        return sum(check_sent(path, kind, body) for path, _, kind, body in calls)
