"""``TracingMiddleware``: one span per sandbox operation."""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextvars import Token
from typing import Any, ClassVar, TypeVar, cast

from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, TracerProvider

from .._bounds import NON_NEGATIVE_WHOLE, Bounds
from .._core import Operation, ProviderMiddleware
from .._protocol import SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSnapshot, SupportsSandboxSnapshot
from .._telemetry import (
    PROVIDER_ATTR,
    SANDBOX_ID_ATTR,
    SNAPSHOT_ID_ATTR,
    Tracing,
    global_gate,
    record_error,
    report_once,
    safely,
)

__all__ = ["TracingMiddleware"]

T = TypeVar("T")

COMMAND_ATTR = "nemo.gym.sandbox.command"
# NeMo Gym's facade sets these two on its gym.sandbox.exec span.
RETURN_CODE_ATTR = "nemo.gym.sandbox.return_code"
EXEC_ERROR_ATTR = "nemo.gym.sandbox.error_type"
SNAPSHOT_SIZE_ATTR = "nemo.gym.sandbox.snapshot_size_bytes"


class TracingMiddleware(ProviderMiddleware):
    """Spans ``gym.sandbox.start`` (create), ``gym.sandbox.exec``, ``gym.sandbox.upload``,
    ``gym.sandbox.download``, ``gym.sandbox.status`` and ``gym.sandbox.stop`` (close).

    Where the provider takes snapshots, also ``gym.sandbox.snapshot`` (with the snapshot's
    ``nemo.gym.sandbox.snapshot_id`` and ``nemo.gym.sandbox.snapshot_size_bytes``) and
    ``gym.sandbox.delete_snapshot``; a create from a snapshot is a ``gym.sandbox.start`` span carrying
    the snapshot's id.

    Each span carries ``nemo.gym.sandbox.provider`` and, once known, ``nemo.gym.sandbox.id``. An
    operation that raised ends its span with error status, the exception recorded and
    ``error.type`` set; cancellation is not an error. The span is current while the inner call
    runs, so layers inside (retries) can add events to it.

    Commands often carry secrets: the command text is recorded only with ``record_command=True``,
    truncated to ``command_max_length`` characters. Environment values are never recorded.
    """

    BOUNDS: ClassVar[Bounds] = Bounds("TracingMiddleware", command_max_length=NON_NEGATIVE_WHOLE)

    def __init__(
        self,
        inner: SandboxProvider,
        *,
        tracer_provider: TracerProvider | None = None,
        record_command: bool = False,
        command_max_length: int = 1024,
    ) -> None:
        super().__init__(inner)
        self.BOUNDS.check(locals())
        self._tracing = Tracing(tracer_provider)
        # Without an SDK there are no spans: no operation is wrapped.
        self._gate = global_gate("trace", tracer_provider, self._tracing)
        self.record_command = record_command
        self.command_max_length = command_max_length

    def around(self, operation: Operation[T]) -> Coroutine[Any, Any, T]:  # no frame of its own: exec is hot
        attrs: dict[str, Any] = {}
        handle = operation.handle
        if handle is not None:
            attrs[SANDBOX_ID_ATTR] = handle.sandbox_id
        command = operation.command if self.record_command else None
        if command is not None:
            attrs[COMMAND_ATTR] = command[: self.command_max_length]
        source = operation.extensions.get("from_snapshot") if operation.name == "create" else None
        if isinstance(source, SandboxSnapshot):
            attrs[SNAPSHOT_ID_ATTR] = source.snapshot_id
        return self._traced(operation.name, attrs, operation)

    async def _traced(self, name: str, attrs: dict[str, Any], call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` in the span of operation ``name``, current while it runs."""
        tracer = self._tracing.get()
        if tracer is None:
            return await call()
        span_name = _SPAN_NAMES[name]
        span: Span | None = None
        token: Token[Context] | None = None
        try:
            span = tracer.start_span(span_name, attributes={PROVIDER_ATTR: self.name, **attrs})
            token = context.attach(trace.set_span_in_context(span))
        except Exception as exc:
            report_once(f"starting span {span_name}", exc)
        if span is None:
            return await call()
        try:
            result = await call()
        except Exception as exc:
            safely(f"span {span_name}", record_error, span, exc)
            raise
        else:
            on_result = _ON_RESULT.get(name)
            if on_result is not None:
                safely(f"span {span_name}", on_result, span, result)
            return result
        finally:
            try:
                if token is not None:
                    context.detach(token)
                span.end()
            except Exception as exc:
                report_once(f"span {span_name}", exc)

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        inner = cast("SupportsSandboxSnapshot", self.inner)
        attrs = {SANDBOX_ID_ATTR: handle.sandbox_id} if isinstance(handle, SandboxHandle) else {}
        return await self._traced("snapshot", attrs, lambda: inner.snapshot(handle, paths=paths, metadata=metadata))

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        inner = cast("SupportsSandboxSnapshot", self.inner)
        attrs = {SNAPSHOT_ID_ATTR: snapshot.snapshot_id} if isinstance(snapshot, SandboxSnapshot) else {}
        return await self._traced("delete_snapshot", attrs, lambda: inner.delete_snapshot(snapshot))


def _set_id(span: Span, handle: SandboxHandle) -> None:
    span.set_attribute(SANDBOX_ID_ATTR, handle.sandbox_id)


def _set_snapshot(span: Span, snapshot: SandboxSnapshot) -> None:
    span.set_attribute(SNAPSHOT_ID_ATTR, snapshot.snapshot_id)
    span.set_attribute(SNAPSHOT_SIZE_ATTR, snapshot.size_bytes)


def _set_exec_result(span: Span, result: SandboxExecResult) -> None:
    span.set_attribute(RETURN_CODE_ATTR, result.return_code)
    if result.error_type is not None:
        span.set_attribute(EXEC_ERROR_ATTR, result.error_type)


_SPAN_NAMES = {
    "create": "gym.sandbox.start",
    "exec": "gym.sandbox.exec",
    "upload": "gym.sandbox.upload",
    "download": "gym.sandbox.download",
    "status": "gym.sandbox.status",
    "close": "gym.sandbox.stop",
    "snapshot": "gym.sandbox.snapshot",
    "delete_snapshot": "gym.sandbox.delete_snapshot",
}
# What a span records of an operation's result.
_ON_RESULT: dict[str, Callable[[Span, Any], None]] = {
    "create": _set_id,
    "exec": _set_exec_result,
    "snapshot": _set_snapshot,
}
