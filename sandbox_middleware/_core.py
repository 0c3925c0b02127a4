"""The middleware core: ``ProviderMiddleware`` and its ``Operation``, ``Middleware`` and ``stack``."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from ._errors import as_create_error
from ._nemo import NEMO_GYM, NemoCreateError
from ._protocol import CAPABILITIES, SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSpec, SandboxStatus

__all__ = ["OPERATIONS", "Middleware", "Operation", "ProviderMiddleware", "innermost", "stack"]

P = ParamSpec("P")
T = TypeVar("T")

OPERATIONS = ("create", "exec", "upload", "download", "status", "close")
"""The names of the six operations of a provider, as ``Operation.name`` gives them."""
_ALL = frozenset(OPERATIONS)
_NONE: frozenset[str] = frozenset()
_EXEC_OPTIONS = ("cwd", "env", "timeout_s", "user")


def _methods(protocol: type) -> tuple[str, ...]:
    return tuple(name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_")


# Each capability protocol and the methods it consists of, read from the protocol itself: adding a
# capability is one entry in ``CAPABILITIES``.
_CAPABILITY_METHODS: tuple[tuple[type, tuple[str, ...]], ...] = tuple((p, _methods(p)) for p in CAPABILITIES)


class Operation(Generic[T]):
    """One call of a provider operation on its way through a layer's ``around``.

    ``name`` is the operation: ``"create"``, ``"exec"``, ``"upload"`` (``upload_file``),
    ``"download"`` (``download_file``), ``"status"`` or ``"close"``. ``handle`` is the sandbox's
    ``SandboxHandle`` (None for create), ``command`` the exec command (None for the others), ``spec``
    the create ``SandboxSpec`` (None for the others), ``extensions`` the keyword arguments a provider
    adds to the operation (``stdin=``), which reach the inner provider unchanged.

    ``await operation()`` runs the operation on the inner provider and returns its result, again
    each time it is called (a retrying layer calls it once per attempt). ``ProviderMiddleware``
    makes one for each call it routes through ``around``; its constructor is not for layers.
    """

    __slots__ = ("_args", "_call", "_kwargs", "handle", "name")

    def __init__(
        self,
        name: str,
        handle: SandboxHandle | None,
        call: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.name = name
        self.handle = handle
        self._call = call
        self._args = args
        self._kwargs = kwargs

    def __call__(self) -> Awaitable[T]:
        return self._call(*self._args, **self._kwargs)

    @property
    def command(self) -> str | None:
        command: str | None = self._args[1] if self.name == "exec" else None
        return command

    @property
    def spec(self) -> SandboxSpec | None:
        spec: SandboxSpec | None = self._args[0] if self.name == "create" else None
        return spec

    @property
    def extensions(self) -> dict[str, Any]:
        """The provider's own keyword arguments of this call (a copy)."""
        return {key: value for key, value in self._kwargs.items() if self.name != "exec" or key not in _EXEC_OPTIONS}

    def __repr__(self) -> str:
        what = f" {self.command!r}" if self.name == "exec" else ""
        on = f" on {self.handle.sandbox_id}" if self.handle is not None else ""
        return f"<Operation {self.name}{what}{on}>"


class _Gate(Protocol):
    def get(self) -> object: ...


class _Open:
    """The gate of a layer whose ``around`` is always on: ``get()`` is never None."""

    __slots__ = ()

    def get(self) -> object:
        return True


_OPEN = _Open()


async def _translated_create(
    create: Callable[..., Coroutine[Any, Any, SandboxHandle]], spec: SandboxSpec, **extensions: Any
) -> SandboxHandle:
    """``create`` of a provider under the innermost layer, whose NeMo Gym ``SandboxCreateError`` comes
    out as an instance of both libraries' class (``as_create_error``), so either ``except`` catches it."""
    try:
        return await create(spec, **extensions)
    except NemoCreateError as exc:  # type: ignore[misc]  # a class of NeMo Gym's, here where it is installed
        translated = as_create_error(exc)
        if translated is exc:  # already ours (ours derive from NeMo Gym's)
            raise
        raise translated from exc


class ProviderMiddleware:
    """A ``SandboxProvider`` that delegates every call to ``inner``: the base class of every layer.

    Subclass it, call ``super().__init__(inner)``, and override one method::

        async def around(self, operation: Operation[T]) -> T:
            return await operation()

    Every one of the six operations (create, exec, upload_file, download_file, status, close)
    passes through ``around`` as an ``Operation``: its ``name`` (``"create"``, ``"exec"``,
    ``"upload"``, ``"download"``, ``"status"``, ``"close"``), its ``handle`` (None for create),
    ``command`` (exec), ``spec`` (create) and ``extensions``; ``await operation()`` runs it on
    ``inner``, again each time it is called. Do what the layer does before and after, catch what
    it raises, call it again to retry. Keyword arguments a provider adds to an operation
    (``stdin=`` on NeMo Gym's Docker ``exec``) reach ``inner`` unchanged. A layer that does not
    override ``around`` is a pure pass-through and builds no ``Operation``; one that needs an
    operation's own arguments (a changed spec) may override that operation instead, with its
    signature and ``**extensions``, and call ``self.inner``. ``aclose`` is not an operation: it
    is forwarded, and overridden where a layer has something to release.

    Every optional capability (``CAPABILITIES``: endpoint, connect, PTY, PTY attach, pause/resume,
    network, port forwarding, shared storage, runtime requirements, background services, list,
    snapshot) is forwarded to ``inner`` exactly when ``inner`` has it, so ``isinstance`` against
    the runtime-checkable protocols tells the truth through any number of layers; a subclass that
    overrides e.g. ``connect`` to observe it never claims a capability its inner provider lacks.
    Layers pickle and copy (``pickle``, ``copy``, a Ray task) with their options and capabilities.
    """

    inner: SandboxProvider
    name: str
    # Which operations reach ``around``, read on every call and so kept to one set lookup and one
    # call: those in ``_wrapped`` (none unless the class overrides ``around``, all six if it does;
    # a layer may narrow it, as RetryMiddleware narrows it to its ``operations``) while
    # ``_gate.get()`` is not None (telemetry layers: their tracer or instruments, None while no
    # SDK is installed). The others go straight to ``inner``, without an ``Operation``.
    _wrapped: frozenset[str] = _NONE
    _gate: _Gate = _OPEN

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "around" in vars(cls) and "_wrapped" not in vars(cls):
            cls._wrapped = _ALL

    def __init__(self, inner: SandboxProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.__class__ = _layer_class(type(self), inner)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # By the class the user wrote, not the one this instance was switched to.
        return (_new_layer, (_written_class(type(self)),), self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__class__ = _layer_class(type(self), self.inner)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.inner!r})"

    async def around(self, operation: Operation[T]) -> T:
        """Run ``operation`` (``await operation()``) with what this layer adds; the default adds nothing."""
        return await operation()

    # The six operations are plain methods that return the awaitable of ``around`` or of ``inner``
    # rather than coroutines of their own: a pass-through layer then adds no frame for the collector
    # to track per call (thousands of calls in flight each held four or five), and costs one call.
    def create(self, spec: SandboxSpec, **extensions: Any) -> Coroutine[Any, Any, SandboxHandle]:
        create: Callable[..., Coroutine[Any, Any, SandboxHandle]] = self.inner.create
        if NEMO_GYM is not None and not isinstance(self.inner, ProviderMiddleware):
            create = partial(_translated_create, create)  # the innermost layer: a NeMo Gym provider's error
        if "create" in self._wrapped and self._gate.get() is not None:
            return self.around(Operation("create", None, create, (spec,), extensions))
        return create(spec, **extensions)

    def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
        **extensions: Any,
    ) -> Coroutine[Any, Any, SandboxExecResult]:
        if "exec" in self._wrapped and self._gate.get() is not None:
            options = {"cwd": cwd, "env": env, "timeout_s": timeout_s, "user": user, **extensions}
            return self.around(Operation("exec", handle, self.inner.exec, (handle, command), options))
        # Without extensions a plain keyword call: exec is the hot path, and a ``**`` call merges a
        # dict in every layer (measured: +0.4 us per layer).
        if extensions:
            return self.inner.exec(handle, command, cwd=cwd, env=env, timeout_s=timeout_s, user=user, **extensions)
        return self.inner.exec(handle, command, cwd=cwd, env=env, timeout_s=timeout_s, user=user)

    def upload_file(
        self, handle: SandboxHandle, source_path: Path, target_path: str, **extensions: Any
    ) -> Coroutine[Any, Any, None]:
        if "upload" in self._wrapped and self._gate.get() is not None:
            args = (handle, source_path, target_path)
            return self.around(Operation("upload", handle, self.inner.upload_file, args, extensions))
        return self.inner.upload_file(handle, source_path, target_path, **extensions)

    def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path, **extensions: Any
    ) -> Coroutine[Any, Any, None]:
        if "download" in self._wrapped and self._gate.get() is not None:
            args = (handle, source_path, target_path)
            return self.around(Operation("download", handle, self.inner.download_file, args, extensions))
        return self.inner.download_file(handle, source_path, target_path, **extensions)

    def status(self, handle: SandboxHandle, **extensions: Any) -> Coroutine[Any, Any, SandboxStatus]:
        if "status" in self._wrapped and self._gate.get() is not None:
            return self.around(Operation("status", handle, self.inner.status, (handle,), extensions))
        return self.inner.status(handle, **extensions)

    def close(self, handle: SandboxHandle, **extensions: Any) -> Coroutine[Any, Any, None]:
        if "close" in self._wrapped and self._gate.get() is not None:
            return self.around(Operation("close", handle, self.inner.close, (handle,), extensions))
        return self.inner.close(handle, **extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _forwarder(protocol: type, name: str) -> Callable[..., Any]:
    """``name`` of ``protocol`` forwarded to ``self.inner``, with the protocol's signature and docs."""
    declared = vars(protocol)[name]
    forward: Callable[..., Any]
    if inspect.iscoroutinefunction(declared):

        async def forward(self: ProviderMiddleware, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.inner, name)(*args, **kwargs)

    else:

        def forward(self: ProviderMiddleware, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = name
    forward.__qualname__ = f"ProviderMiddleware.{name}"
    forward.__doc__ = f"{protocol.__name__}.{name}, forwarded to the inner provider."
    setattr(forward, "__signature__", inspect.signature(declared))  # noqa: B010 - shown by help() and inspect
    return forward


_FORWARDERS: dict[str, Callable[..., Any]] = {
    name: _forwarder(protocol, name) for protocol, names in _CAPABILITY_METHODS for name in names
}
# (class the user wrote, which capabilities its inner provider has) -> the class a layer is made of.
_layer_classes: dict[tuple[type, tuple[bool, ...]], type] = {}
_written: dict[type, type] = {}


def _written_class(cls: type) -> type:
    return _written.get(cls, cls)


def _layer_class(cls: type, inner: object) -> type:
    """``cls`` with the capabilities of ``inner``: forwarded if present, hidden if absent.

    Present ones the class does not define itself get a forwarder. Absent ones that it defines
    (a subclass observing ``connect``) are set to None on the class, the idiom both the 3.11 and
    the 3.12+ ``isinstance`` checks of runtime-checkable protocols read as "not implemented"
    (3.11 asks the class first, so an instance attribute would not do). The result keeps
    ``cls``'s name, docs and signature; it is ``cls`` itself when nothing needs to change.
    """
    cls = _written_class(cls)
    present = tuple(isinstance(inner, protocol) for protocol, _ in _CAPABILITY_METHODS)
    key = (cls, present)
    layer = _layer_classes.get(key)
    if layer is None:
        defined = {name for klass in cls.__mro__ for name in vars(klass)}
        namespace: dict[str, Any] = {}
        for (_, names), has in zip(_CAPABILITY_METHODS, present, strict=True):
            for name in names:
                if has and name not in defined:
                    namespace[name] = _FORWARDERS[name]
                elif not has and name in defined:
                    namespace[name] = None
        if namespace:
            namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
            layer = type(cls.__name__, (cls,), namespace)
            _written[layer] = cls
        else:
            layer = cls
        _layer_classes[key] = layer
    return layer


def _new_layer(cls: type) -> Any:
    """An uninitialised ``cls`` for unpickling; ``__setstate__`` restores it and its capabilities."""
    return object.__new__(cls)


def reduce_to_options(cls: type[ProviderMiddleware], layer: ProviderMiddleware) -> tuple[Any, ...]:
    """The ``__reduce_ex__`` of a layer whose state belongs to its process (slots, pools, tasks): a new
    ``cls`` over the same inner provider, built from the layer's options, each keyword-only parameter
    of ``cls`` read back from the attribute of its name; ``meter_provider`` stays behind (the receiving
    process's global one serves)."""
    parameters = inspect.signature(cls).parameters.values()
    names = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "meter_provider"]
    return (_rebuilt, (cls, layer.inner, {name: getattr(layer, name) for name in names}))


def _rebuilt(cls: type[ProviderMiddleware], inner: SandboxProvider, options: dict[str, Any]) -> ProviderMiddleware:
    return cls(inner, **options)


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


def innermost(provider: Any) -> Any:
    """The provider under every layer of a stack (``provider`` itself when it has no ``inner``)."""
    while getattr(provider, "inner", None) is not None:
        provider = provider.inner
    return provider
