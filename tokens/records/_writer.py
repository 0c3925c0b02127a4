"""Capture writes records: a rollout's coordinates per request, and the record put before the
response is handed back.

Coordinates come as headers (``X-Rollout-Id``, ``X-Model-Call-Id``, ``X-Parent-Call-Id``,
``X-Weight-Version``) or as top-level request fields of the record's names (``rollout_id``,
``model_call_id``, ``parent_call_id``, ``weight_version``); ``take_coordinates`` removes both so
neither reaches the server. ``RecordWriter`` is what ``TokenClient`` and
``TokenCaptureTransport`` run with ``sink=``, and what a proxy of its own can run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from .._bundle import TokenBundle, TokenCompletion, WeightVersionSpan
from .._errors import ResponseTooLargeError, TokenCaptureError, UnsupportedRequestError
from ._coordinates import Coordinates, check_weight_version
from ._digest import compute_digest
from ._errors import RecordWriteError
from ._fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from ._record import RESOLVED, ROOT, UNRESOLVED, TokenRecord, record_payload
from ._store import RecordStore
from ._types import NEMO_TOKEN_ENTRY, LineageMatch, ParentResolutionStatus

__all__ = ["Custody", "RecordWriter", "capture_failed", "custody", "refuse_unrecordable"]

logger = logging.getLogger("tokens.records")

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
MARK_TIMEOUT_S = 10.0
"""How long marking a failed call's rollout incomplete may take (shielded: it runs on cancellation too)."""


def output_items(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's first choice as a Responses-style message item, token arrays removed."""
    choices = response.get("choices") or []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        return []
    item = {key: value for key, value in message.items() if key not in TOKEN_FIELDS}
    item.setdefault("type", "message")
    item.setdefault("role", "assistant")
    return [item]


def spans_for(bundle: TokenBundle, version: str | None) -> list[dict[str, Any]] | None:
    """The record's ``weight_versions``: the server's spans, else one span of the known version."""
    spans: Sequence[WeightVersionSpan] = bundle.weight_versions
    if not spans and version is not None and bundle.generation_token_ids:
        spans = (WeightVersionSpan(version, 0, len(bundle.generation_token_ids)),)
    return [{"version": s.version, "start": s.start, "end": s.end} for s in spans] if spans else None


class RecordWriter:
    """Writes one record per captured call into ``sink`` (a ``TokenSink``; our ``RecordStore`` is
    also the lineage resolver). ``weight_version`` is the default policy version (a request's
    own, or the server's spans, take precedence).

    ``begin`` runs before the request is sent (``begin_call`` when the sink has it: a frozen
    rollout refuses the call before any compute). ``write_*`` resolves the parent, builds the
    record (delta prompt when the parent is verified) and awaits ``put``. When ``put`` fails the
    rollout is marked incomplete and the response still goes back (NeMo Gym's rule: a capture
    error never fails the model call); when marking fails too, ``RecordWriteError`` is raised.
    A parent lookup that fails (the store unreachable, a corrupt parent chain) leaves the record
    ``unresolved`` with the reason ``lineage_lookup_failed: <error type>``.
    """

    def __init__(self, sink: Any, *, weight_version: str | None = None) -> None:
        for method in ("put", "mark_incomplete"):
            if not callable(getattr(sink, method, None)):
                raise TypeError(
                    f"sink= must be a token sink with async put and mark_incomplete (such as "
                    f"tokens.records.open_store(url)); {type(sink).__name__} has no {method}"
                )
        self.sink = sink
        self.weight_version = None if weight_version is None else check_weight_version(weight_version, "weight_version")

    def custody(self, coordinates: Coordinates, *, failed: Callable[[BaseException], bool] | None = None) -> Custody:
        """A call's custody (``async with``): begun on entry, marked incomplete on exit by a capture
        failure (``failed``, default ``capture_failed``) or a cancellation unless its record was written."""
        return Custody(self, coordinates, capture_failed if failed is None else failed)

    async def begin(self, coordinates: Coordinates) -> None:
        begin_call = getattr(self.sink, "begin_call", None)
        if begin_call is not None:
            await begin_call(coordinates.rollout_id, coordinates.model_call_id)

    async def write_chat(
        self,
        coordinates: Coordinates,
        request: Mapping[str, Any],
        completion: TokenCompletion,
        server_version: str | None = None,
        *,
        dropped: Sequence[Mapping[str, Any]] = (),
        served_by: str | None = None,
    ) -> None:
        """Record a chat completion's first choice (``n`` must be 1 with a sink); ``dropped``: what was
        left out of the caller's request before it was sent (the record's ``dropped``); ``served_by``:
        the upstream replica that answered it (the record's ``served_by``)."""
        messages = request.get("messages")
        items = list(messages) if isinstance(messages, list) else []
        outputs = output_items(completion.response)
        server_version = server_version or _reported_version(completion.response)
        await self._write(coordinates, completion, items, outputs, server_version, dropped, served_by)

    async def mark_failed(self, coordinates: Coordinates) -> None:
        """The call's capture failed: the rollout is marked incomplete, shielded and within
        ``MARK_TIMEOUT_S`` (best effort: the call's own error is what the caller gets)."""
        marked = False
        with anyio.CancelScope(shield=True), anyio.move_on_after(MARK_TIMEOUT_S):
            try:
                await self.sink.mark_incomplete(coordinates.rollout_id, coordinates.model_call_id)
                marked = True
            except Exception as exc:  # the caller gets the capture error either way
                logger.warning(
                    "rollout %r, model call %r: capture failed and the rollout could not be marked incomplete (%s)",
                    coordinates.rollout_id,
                    coordinates.model_call_id,
                    type(exc).__name__,
                )
                return
        if not marked:
            logger.warning(
                "rollout %r, model call %r: capture failed and marking the rollout incomplete took over %g s",
                coordinates.rollout_id,
                coordinates.model_call_id,
                MARK_TIMEOUT_S,
            )

    async def write_token_in(
        self, coordinates: Coordinates, completion: TokenCompletion, *, served_by: str | None = None
    ) -> None:
        """Record a token-in call (``/v1/completions``, ``/inference/v1/generate``): the parent is
        the recorded sequence the prompt extends, verified by digest; ``served_by`` as ``write_chat``'s."""
        await self._write(coordinates, completion, None, [], _reported_version(completion.response), (), served_by)

    async def _write(
        self,
        coordinates: Coordinates,
        completion: TokenCompletion,
        items: list[Any] | None,
        outputs: list[dict[str, Any]],
        server_version: str | None,
        dropped: Sequence[Mapping[str, Any]] = (),
        served_by: str | None = None,
    ) -> None:
        bundle = completion.bundle
        try:
            status, match, reason = await self._parent(coordinates, bundle, items)
        except Exception as exc:  # a capture error never fails the model call: the record says why
            logger.warning(
                "rollout %r, model call %r: the parent lookup failed (%r); recorded as unresolved",
                coordinates.rollout_id,
                coordinates.model_call_id,
                exc,
            )
            status, match, reason = UNRESOLVED, None, f"lineage_lookup_failed: {type(exc).__name__}"
        prompt = bundle.prompt_token_ids
        delta = False
        if match is not None:
            parent = match.cumulative_token_ids
            if len(prompt) >= len(parent) and tuple(prompt[: len(parent)]) == parent:
                prompt, delta = prompt[len(parent) :], True
            else:
                reason = reason or "prompt_does_not_extend_parent"
        full = bundle.prompt_token_ids + bundle.generation_token_ids
        fingerprint, context_digest = "", ""
        if items is not None:
            try:
                fingerprint = assistant_fingerprint([*items, *outputs])
                context_digest = conversation_digest(items)
            except ValueError:
                fingerprint, context_digest = "", ""  # content no fingerprint covers: resolvable by parent id only
        version = coordinates.weight_version or server_version or self.weight_version
        record = TokenRecord(
            rollout_id=coordinates.rollout_id,
            model_call_id=coordinates.model_call_id,
            model=str(completion.response.get("model") or ""),
            prompt_token_ids=list(prompt),
            generation_token_ids=bundle.generation_token_ids,
            generation_log_probs=bundle.generation_log_probs,
            routed_experts=bundle.routed_experts,
            output_items=outputs,
            token_item_index=0 if outputs else None,
            response_id=_response_id(completion.response),
            created_at=time.time(),
            parent_call_id=match.model_call_id if match is not None else None,
            cum_len=len(full),
            digest=compute_digest(full),
            parent_resolution=status,
            continuation_fingerprint=fingerprint,
            continuation_context_len=len(items) if fingerprint and items is not None else 0,
            continuation_context_digest=context_digest,
            parent_resolution_reason=reason,
            fingerprint_version=FINGERPRINT_VERSION if fingerprint else None,
            prompt_is_delta=delta,
            weight_versions=spans_for(bundle, version),
            dropped=[dict(note) for note in dropped] or None,
            served_by=served_by,
        )
        await self._put(record)

    async def _parent(
        self, coordinates: Coordinates, bundle: TokenBundle, items: list[Any] | None
    ) -> tuple[str, LineageMatch | None, str]:
        """(parent_resolution, the verified parent or None, the reason)."""
        sink, rollout = self.sink, coordinates.rollout_id
        if coordinates.parent_call_id is not None:
            matcher = getattr(sink, "match", None)
            if matcher is None:
                return UNRESOLVED, None, f"parent_call_id {coordinates.parent_call_id!r} given, no store to verify it"
            match = await matcher(rollout, coordinates.parent_call_id)
            if match is None:
                return UNRESOLVED, None, f"parent_call_id {coordinates.parent_call_id!r} has no record in the rollout"
            return RESOLVED, match, "parent_call_id"
        if items is not None and callable(getattr(sink, "resolve", None)):
            resolution = await sink.resolve(rollout, items)
        elif items is None and callable(getattr(sink, "resolve_prefix", None)):
            resolution = await sink.resolve_prefix(rollout, bundle.prompt_token_ids)
        else:
            return UNRESOLVED, None, "no_lineage_resolver"
        status = str(ParentResolutionStatus(resolution.status).value)
        return status, resolution.match, resolution.reason if status != ROOT else ""

    async def _put(self, record: TokenRecord) -> None:
        entry: Any = record
        if NEMO_TOKEN_ENTRY is not None and not isinstance(self.sink, RecordStore):
            entry = NEMO_TOKEN_ENTRY.model_validate(record_payload(record))  # NeMo Gym's own sinks get its class
        try:
            await self.sink.put(entry)
        except Exception as exc:
            try:
                await self.sink.mark_incomplete(record.rollout_id, record.model_call_id)
            except Exception as mark_exc:
                raise RecordWriteError(
                    f"rollout {record.rollout_id!r}, model call {record.model_call_id!r}: the record was not stored "
                    f"({exc!r}) and the rollout could not be marked incomplete ({mark_exc!r}); check the store"
                ) from exc
            logger.warning(
                "rollout %r, model call %r: the record was not stored (%r); the rollout is marked incomplete",
                record.rollout_id,
                record.model_call_id,
                exc,
            )


def capture_failed(exc: BaseException) -> bool:
    """Whether a call's failure left what the server generated uncaptured (its rollout has a hole)."""
    return isinstance(exc, TokenCaptureError | ResponseTooLargeError)


class Custody:
    """One recorded call in a ``RecordWriter``'s custody, from before it is sent to its record.

    ``async with writer.custody(coordinates) as call``: entering begins the call (``begin_call``: a
    frozen rollout refuses it before any compute); ``write_chat`` / ``write_token_in`` put its record;
    leaving without a record, by a capture failure (``failed``) or a cancellation, marks the rollout
    incomplete (shielded, bounded). Any other failure (the server's HTTP error, a lost connection)
    leaves the call begun, so a retry under the same model call id can still complete it.
    ``begin`` and ``end`` are the same steps for a call whose custody outlives one block (a stream).
    ``served_by``, when the caller sets it, names the upstream replica in the record; ``dropped``, what
    was left out of the caller's request before it was sent (the record's ``dropped``).
    """

    recorded = True
    """Whether the call is recorded (False for the custody of a call without a sink or a rollout id)."""
    served_by: str | None = None
    dropped: Sequence[Mapping[str, Any]] = ()

    def __init__(self, writer: RecordWriter, coordinates: Coordinates, failed: Callable[[BaseException], bool]) -> None:
        self.writer = writer
        self.coordinates = coordinates
        self.failed = failed
        self.written = False

    async def begin(self) -> None:
        await self.writer.begin(self.coordinates)

    async def write_chat(
        self, request: Mapping[str, Any], completion: TokenCompletion, server_version: str | None = None
    ) -> None:
        await self.writer.write_chat(
            self.coordinates, request, completion, server_version, dropped=self.dropped, served_by=self.served_by
        )
        self.written = True

    async def write_token_in(self, completion: TokenCompletion) -> None:
        await self.writer.write_token_in(self.coordinates, completion, served_by=self.served_by)
        self.written = True

    async def end(self, exc: BaseException | None) -> None:
        if exc is None or self.written:
            return
        if isinstance(exc, anyio.get_cancelled_exc_class()) or self.failed(exc):
            await self.writer.mark_failed(self.coordinates)

    async def __aenter__(self) -> Custody:
        await self.begin()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        await self.end(exc)


class _Unrecorded(Custody):
    """The custody of a call that is not recorded (no sink, or no rollout id): every step does nothing."""

    recorded = False

    def __init__(self) -> None:
        self.written = False

    async def begin(self) -> None:
        return

    async def write_chat(self, *args: Any, **kwargs: Any) -> None:
        return

    async def write_token_in(self, *args: Any, **kwargs: Any) -> None:
        return

    async def end(self, exc: BaseException | None) -> None:
        return


UNRECORDED: Custody = _Unrecorded()


def custody(writer: RecordWriter | None, coordinates: Coordinates | None) -> Custody:
    """The custody of one call: ``writer.custody(coordinates)``, or one that records nothing."""
    return UNRECORDED if writer is None or coordinates is None else writer.custody(coordinates)


def _response_id(response: Mapping[str, Any]) -> str | None:
    value = response.get("id") or response.get("request_id")
    return value if isinstance(value, str) else None


def _reported_version(response: Mapping[str, Any]) -> str | None:
    value = response.get("weight_version")
    return value if isinstance(value, str) and value else None


def refuse_unrecordable(body: Mapping[str, Any]) -> None:
    """A recorded call is one non-streamed choice (one record per model call)."""
    if body.get("stream"):
        raise UnsupportedRequestError(
            "stream=true with a rollout id: recorded calls are not streamed yet; send "
            "stream=false, or leave out the rollout id to stream without a record"
        )
    n = body.get("n")
    if n is not None and n != 1:
        raise UnsupportedRequestError(
            f"n={n!r} with a rollout id: a record holds one model call's one choice; "
            "send n=1 per rollout (one rollout id per sample)"
        )
