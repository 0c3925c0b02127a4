"""Where one model call belongs (``Coordinates``), with the one rule every front end checks it by.

The ids (``rollout_id``, ``model_call_id``, ``parent_call_id``) travel in headers, URLs
(``/r/<rollout-id>/v1``) and records, so an id is 1 to 200 of ``A-Z a-z 0-9 . _ : @ -``; a
weight version is a non-empty printable string of at most 200 characters (an int is taken as its
digits). A value that breaks the rule is a ``CoordinateError`` naming where it came from, raised
before anything is sent. ``take_coordinates`` reads them from a request's headers (``X-Rollout-Id``,
``X-Model-Call-Id``, ``X-Parent-Call-Id``, ``X-Weight-Version``) and top-level body fields of the
record's names, and removes both so neither reaches the server.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import CoordinateError

__all__ = [
    "COORDINATE_FIELDS",
    "COORDINATE_HEADERS",
    "Coordinates",
    "check_id",
    "check_weight_version",
    "take_coordinates",
]

COORDINATE_FIELDS = ("rollout_id", "model_call_id", "parent_call_id", "weight_version")
COORDINATE_HEADERS = {f"x-{name.replace('_', '-')}": name for name in COORDINATE_FIELDS}
MAX_COORDINATE_LENGTH = 200
_ID = re.compile(r"[A-Za-z0-9._:@-]{1,200}")


def check_id(value: Any, where: str) -> str:
    """``value`` when it is an id by the rule above; ``CoordinateError`` naming ``where`` otherwise."""
    if not isinstance(value, str) or _ID.fullmatch(value) is None:
        shown = value[:40] if isinstance(value, str) else value
        raise CoordinateError(f"{where}: {shown!r} is not an id (1 to 200 of A-Z a-z 0-9 . _ : @ -)", where)
    return value


def check_weight_version(value: Any, where: str) -> str:
    """A weight version as its string (an int as its digits); ``CoordinateError`` naming ``where`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value or len(value) > MAX_COORDINATE_LENGTH or not value.isprintable():
        raise CoordinateError(
            f"{where}: a weight version is a non-empty printable string of at most {MAX_COORDINATE_LENGTH} characters",
            where,
        )
    return value


@dataclass(frozen=True, slots=True)
class Coordinates:
    """Where one model call belongs: its rollout, its own id, optionally its parent (else found by
    the lineage resolver) and the policy's weight version; checked by the rule above."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        check_id(self.rollout_id, "rollout_id")
        check_id(self.model_call_id, "model_call_id")
        if self.parent_call_id is not None:
            check_id(self.parent_call_id, "parent_call_id")
        if self.weight_version is not None:
            check_weight_version(self.weight_version, "weight_version")


def _check(name: str, value: Any) -> str:
    return check_weight_version(value, name) if name == "weight_version" else check_id(value, name)


def take_coordinates(
    headers: Mapping[str, str], body: Mapping[str, Any]
) -> tuple[Coordinates | None, dict[str, str], dict[str, Any]]:
    """The coordinates of a request and the headers and body without them (what the server gets).

    None when no rollout id was given (then nothing is recorded). A field given both ways must
    agree; a model call id is made (uuid4) when absent: pass one so that a retry is the same call.
    """
    kept_headers: dict[str, str] = {}
    found: dict[str, str] = {}
    for key, value in headers.items():
        name = COORDINATE_HEADERS.get(key.lower())
        if name is None:
            kept_headers[key] = value
        else:
            found[name] = _check(name, value)
    kept_body = {key: value for key, value in body.items() if key not in COORDINATE_FIELDS}
    for name in COORDINATE_FIELDS:
        if name in body and body[name] is not None:
            value = _check(name, body[name])
            if found.get(name, value) != value:
                raise CoordinateError(f"{name}: the header says {found[name]!r}, the body {value!r}; give one", name)
            found[name] = value
    if "rollout_id" not in found:
        if found:
            raise CoordinateError(
                f"{sorted(found)} given without a rollout id (X-Rollout-Id or rollout_id)", "rollout_id"
            )
        return None, kept_headers, kept_body
    coordinates = Coordinates(
        found["rollout_id"],
        found.get("model_call_id") or uuid.uuid4().hex,
        found.get("parent_call_id"),
        found.get("weight_version"),
    )
    return coordinates, kept_headers, kept_body
