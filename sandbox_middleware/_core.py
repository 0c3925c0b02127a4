"""The middleware core: ``ProviderMiddleware``, ``Middleware`` and ``stack``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec

from ._protocol import (
    ConnectableProvider,
    SandboxEndpoint,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SandboxStatus,
    SupportsSandboxEndpoint,
    SupportsSandboxPty,
)

__all__ = ["Middleware", "ProviderMiddleware", "stack"]

P = ParamSpec("P")


class _EndpointPassThrough:
    inner: Any

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint:
        result: SandboxEndpoint = await self.inner.endpoint(handle, port)
        return result


class _ConnectPassThrough:
    inner: Any

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.inner.serialize_handle(handle, scope=scope)
        return result

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        result: SandboxHandle = await self.inner.connect(descriptor)
        return result


class _PtyPassThrough:
    inner: Any

    async def create_pty(self, handle: SandboxHandle, spec: Any) -> Any:
        return await self.inner.create_pty(handle, spec)


# Each optional capability and the mixin that forwards it. A layer gets a mixin exactly when its
# inner provider has the capability, so ``isinstance`` against the runtime-checkable protocol tells
# the truth through any number of layers (attributes come from the class, not ``__getattr__``).
_CAPABILITIES: tuple[tuple[type, type, tuple[str, ...]], ...] = (
    (SupportsSandboxEndpoint, _EndpointPassThrough, ("endpoint",)),
    (ConnectableProvider, _ConnectPassThrough, ("serialize_handle", "connect")),
    (SupportsSandboxPty, _PtyPassThrough, ("create_pty",)),
)
_CAPABILITY_NAMES = frozenset(name for _, _, names in _CAPABILITIES for name in names)
_layer_classes: dict[tuple[type, tuple[bool, ...]], type] = {}


class ProviderMiddleware:
    """A ``SandboxProvider`` that delegates every call to ``inner``.

    Subclass it and override only the operations you change; call ``self.inner`` to go on. The
    optional capabilities (endpoint, connect, PTY) are forwarded exactly when ``inner`` has them.
    A subclass that wants to observe ``connect`` overrides it; the capability still appears only
    when the inner provider has it.
    """

    inner: SandboxProvider
    name: str

    def __new__(cls, inner: SandboxProvider, *args: Any, **kwargs: Any) -> ProviderMiddleware:
        present = tuple(isinstance(inner, protocol) for protocol, _, _ in _CAPABILITIES)
        return super().__new__(_layer_class(cls, present))

    def __init__(self, inner: SandboxProvider) -> None:
        self.inner = inner
        self.name = inner.name

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.inner!r})"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        return await self.inner.create(spec)

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        return await self.inner.exec(handle, command, cwd=cwd, env=env, timeout_s=timeout_s, user=user)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        await self.inner.upload_file(handle, source_path, target_path)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        await self.inner.download_file(handle, source_path, target_path)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        return await self.inner.status(handle)

    async def close(self, handle: SandboxHandle) -> None:
        await self.inner.close(handle)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _layer_class(cls: type, present: tuple[bool, ...]) -> type:
    """``cls`` with the capabilities of its inner provider: forwarded if present, hidden if absent.

    Absent ones are set to None on the class, the idiom both the 3.11 and the 3.12+
    ``isinstance`` checks of runtime-checkable protocols read as "not implemented", so a subclass
    that overrides e.g. ``connect`` never claims a capability its inner provider lacks.
    """
    defined = {name for klass in cls.__mro__ for name in vars(klass)}
    if not any(present) and not defined & _CAPABILITY_NAMES:
        return cls
    key = (cls, present)
    layer = _layer_classes.get(key)
    if layer is None:
        mixins = tuple(mixin for (_, mixin, _), on in zip(_CAPABILITIES, present, strict=True) if on)
        namespace: dict[str, Any] = {
            name: None for (_, _, names), on in zip(_CAPABILITIES, present, strict=True) if not on for name in names
        }
        namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
        layer = type(cls.__name__, (cls, *mixins), namespace)
        _layer_classes[key] = layer
    return layer


class Middleware(Generic[P]):
    """A deferred middleware constructor: the class and its options, without the provider.

    ``Middleware(RetryMiddleware, attempts=5)`` is built later by ``stack`` as
    ``RetryMiddleware(provider, attempts=5)``; type checkers check the options against the class.
    """

    def __init__(
        self,
        cls: Callable[Concatenate[SandboxProvider, P], SandboxProvider],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        self.cls = cls
        self.args: tuple[Any, ...] = args
        self.kwargs: dict[str, Any] = kwargs

    def build(self, inner: SandboxProvider) -> SandboxProvider:
        """Wrap ``inner`` in this middleware."""
        return self.cls(inner, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.cls, "__name__", repr(self.cls))
        options = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Middleware({', '.join([name, *options])})"


def stack(provider: SandboxProvider, middleware: Sequence[Middleware[Any]]) -> SandboxProvider:
    """Wrap ``provider`` in ``middleware``; the first entry is the outermost layer.

    ``stack(p, [Middleware(A), Middleware(B)])`` is ``A(B(p))``: a call passes A, then B, then p,
    and the result comes back through B, then A.
    """
    for entry in reversed(middleware):
        provider = entry.build(provider)
    return provider
