"""``TracingMiddleware``: one span per sandbox operation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import Token
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from opentelemetry import context, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, TracerProvider

from ._bounds import NON_NEGATIVE_WHOLE, Bounds
from ._core import ProviderMiddleware
from ._protocol import SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSpec, SandboxStatus
from ._telemetry import PROVIDER_ATTR, SANDBOX_ID_ATTR, Tracing, record_error, report_once, safely

__all__ = ["TracingMiddleware"]

T = TypeVar("T")

COMMAND_ATTR = "nemo.gym.sandbox.command"
# NeMo Gym's facade sets these two on its gym.sandbox.exec span.
RETURN_CODE_ATTR = "nemo.gym.sandbox.return_code"
EXEC_ERROR_ATTR = "nemo.gym.sandbox.error_type"


class TracingMiddleware(ProviderMiddleware):
    """Spans ``gym.sandbox.start`` (create), ``gym.sandbox.exec``, ``gym.sandbox.upload``,
    ``gym.sandbox.download``, ``gym.sandbox.status`` and ``gym.sandbox.stop`` (close).

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
        self.BOUNDS.check(command_max_length=command_max_length)
        self._tracing = Tracing(tracer_provider)
        self.record_command = record_command
        self.command_max_length = command_max_length

    async def _traced(
        self,
        span_name: str,
        handle: SandboxHandle | None,
        call: Callable[[], Awaitable[T]],
        attributes: dict[str, Any] | None = None,
        on_result: Callable[[Span, T], None] | None = None,
    ) -> T:
        tracer = self._tracing.get()
        if tracer is None:
            return await call()
        span: Span | None = None
        token: Token[Context] | None = None
        try:
            attrs: dict[str, Any] = {PROVIDER_ATTR: self.name}
            if handle is not None:
                attrs[SANDBOX_ID_ATTR] = handle.sandbox_id
            if attributes:
                attrs.update(attributes)
            span = tracer.start_span(span_name, attributes=attrs)
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

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        return await self._traced(
            "gym.sandbox.start", None, partial(self.inner.create, spec, **extensions), on_result=_set_id
        )

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
        **extensions: Any,
    ) -> SandboxExecResult:
        if self._tracing.get() is None:  # the hot path without an SDK: no closure, no extra frame
            return await self._inner_exec(handle, command, cwd, env, timeout_s, user, extensions)
        attributes = {COMMAND_ATTR: command[: self.command_max_length]} if self.record_command else None
        return await self._traced(
            "gym.sandbox.exec",
            handle,
            partial(self._inner_exec, handle, command, cwd, env, timeout_s, user, extensions),
            attributes,
            _set_exec_result,
        )

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str, **extensions: Any) -> None:
        await self._traced(
            "gym.sandbox.upload",
            handle,
            partial(self.inner.upload_file, handle, source_path, target_path, **extensions),
        )

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path, **extensions: Any
    ) -> None:
        await self._traced(
            "gym.sandbox.download",
            handle,
            partial(self.inner.download_file, handle, source_path, target_path, **extensions),
        )

    async def status(self, handle: SandboxHandle, **extensions: Any) -> SandboxStatus:
        return await self._traced("gym.sandbox.status", handle, partial(self.inner.status, handle, **extensions))

    async def close(self, handle: SandboxHandle, **extensions: Any) -> None:
        await self._traced("gym.sandbox.stop", handle, partial(self.inner.close, handle, **extensions))


def _set_id(span: Span, handle: SandboxHandle) -> None:
    span.set_attribute(SANDBOX_ID_ATTR, handle.sandbox_id)


def _set_exec_result(span: Span, result: SandboxExecResult) -> None:
    span.set_attribute(RETURN_CODE_ATTR, result.return_code)
    if result.error_type is not None:
        span.set_attribute(EXEC_ERROR_ATTR, result.error_type)
