"""Provider and middleware registries: built-ins, ``register_*`` calls, entry points, and NeMo Gym's own.

A provider name ``nemo_gym.NAME`` (``nemo_gym.local``, ``nemo_gym.docker``, ...) is looked up in NeMo
Gym's registry (its built-ins, its ``register_provider`` calls and its entry points) when NeMo Gym is
installed, so a config can stack middleware on any NeMo Gym provider.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from ._errors import RegistryError

__all__ = [
    "MIDDLEWARE_GROUPS",
    "NEMO_GYM_PREFIX",
    "PROVIDER_GROUPS",
    "Registry",
    "RegistryError",
    "middleware_registry",
    "provider_registry",
    "register_middleware",
    "register_provider",
]

PROVIDER_GROUPS = ("sandbox_middleware.providers", "nemo_gym.sandbox_providers")
NEMO_GYM_PREFIX = "nemo_gym."
MIDDLEWARE_GROUPS = ("sandbox_middleware.middleware",)
_THIS_DISTRIBUTION = "llm-sandbox-middleware"


@dataclass(frozen=True)
class _Entry:
    load: Callable[[], Any]
    origin: str
    """Where the name comes from: ``built-in (...)``, ``register_...()``, or ``distribution X (group)``."""
    target: str


class Registry:
    """Names to classes. Precedence: ``register()`` calls, then built-ins, then entry points.

    Entry points may not reuse a built-in name, and two distributions may not publish the same
    name (unless both point at the same object): either is an error that names both origins.
    """

    def __init__(
        self,
        kind: str,
        groups: Iterable[str],
        builtins: dict[str, Callable[[], Any]],
        foreign: _NemoGymProviders | None = None,
    ) -> None:
        self.kind = kind
        self._foreign = foreign
        self.groups = tuple(groups)
        self._builtins = {
            name: _Entry(load, f"built-in ({_THIS_DISTRIBUTION})", name) for name, load in builtins.items()
        }
        self._registered: dict[str, _Entry] = {}
        self._discovered: dict[str, _Entry] | None = None

    def register(self, name: str, cls: Any, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} name must be a non-empty string, not {name!r}")
        if name in self._registered and not replace:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered ({self._registered[name].target}); "
                "pass replace=True to replace it"
            )
        self._registered[name] = _Entry(lambda: cls, f"register_{self.kind}()", _qualname(cls))

    def _entry_points(self) -> dict[str, _Entry]:
        if self._discovered is not None:
            return self._discovered
        found: dict[str, _Entry] = {}
        for group in self.groups:
            for ep in metadata.entry_points(group=group):
                dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
                entry = _Entry(ep.load, f"distribution {dist!r} ({group})", ep.value)
                clash = self._builtins.get(ep.name) or found.get(ep.name)
                if clash is not None and clash.target != entry.target:
                    raise RegistryError(
                        f"duplicate {self.kind} name {ep.name!r}: {clash.origin} -> {clash.target} and "
                        f"{entry.origin} -> {entry.target}; uninstall one of them or register one explicitly "
                        f"with register_{self.kind}()"
                    )
                if ep.name not in self._builtins:
                    found.setdefault(ep.name, entry)
        self._discovered = found
        return found

    def names(self) -> list[str]:
        foreign = self._foreign.names() if self._foreign is not None else []
        return sorted({*self._registered, *self._builtins, *self._entry_points(), *foreign})

    def origin(self, name: str) -> str:
        return self._lookup(name).origin

    def _lookup(self, name: str) -> _Entry:
        entry = self._registered.get(name) or self._builtins.get(name)
        if entry is None and self._foreign is not None:
            entry = self._foreign.lookup(name)
        if entry is None:
            entry = self._entry_points().get(name)
        if entry is None:
            raise RegistryError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return entry

    def get(self, name: str) -> Any:
        """The class registered under ``name``."""
        return self._lookup(name).load()

    def refresh(self) -> None:
        """Forget the entry points found so far (after installing a distribution at run time)."""
        self._discovered = None


class _NemoGymProviders:
    """``nemo_gym.NAME``: the providers of NeMo Gym's own registry, when NeMo Gym is installed."""

    module = "nemo_gym.sandbox.providers.registry"

    def _registry(self) -> Any:
        try:
            return importlib.import_module(self.module)
        except ImportError:
            return None

    def names(self) -> list[str]:
        registry = self._registry()
        return [] if registry is None else [NEMO_GYM_PREFIX + name for name in registry.list_providers()]

    def lookup(self, name: str) -> _Entry | None:
        if not name.startswith(NEMO_GYM_PREFIX):
            return None
        registry = self._registry()
        if registry is None:
            raise RegistryError(
                f"provider {name!r} comes from NeMo Gym, which is not installed here; install nemo-gym, "
                f"or use a provider of this package (e.g. 'local')"
            )

        def load() -> Any:
            try:
                return registry.get_provider_class(name.removeprefix(NEMO_GYM_PREFIX))
            except ValueError as exc:  # NeMo Gym's "Unknown sandbox provider ..., Available providers: ..."
                raise RegistryError(f"{name!r}: {exc}") from exc

        return _Entry(load, f"NeMo Gym's registry ({self.module})", name)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _local() -> Any:
    from .providers.local import LocalProvider

    return LocalProvider


def _docker() -> Any:
    from .providers.docker import DockerProvider

    return DockerProvider


def _builtin_middleware() -> dict[str, Callable[[], Any]]:
    def load(module: str, name: str) -> Callable[[], Any]:
        def loader() -> Any:
            return getattr(importlib.import_module(module, __package__), name)

        return loader

    return {
        "tracing": load(".middleware._tracing", "TracingMiddleware"),
        "metrics": load(".middleware._metrics", "MetricsMiddleware"),
        "release_accounting": load(".middleware._release_accounting", "ReleaseAccountingMiddleware"),
        "retry": load(".middleware._retry", "RetryMiddleware"),
        "ownership": load(".middleware._ownership", "OwnershipMiddleware"),
        "admission": load(".middleware.admission", "AdmissionMiddleware"),
        "warm_pool": load(".middleware._warm_pool", "WarmPoolMiddleware"),
    }


provider_registry = Registry(
    "provider",
    PROVIDER_GROUPS,
    {"local": _local, "docker": _docker},
    _NemoGymProviders(),
)
middleware_registry = Registry("middleware", MIDDLEWARE_GROUPS, _builtin_middleware())


def register_provider(name: str, cls: Any, *, replace: bool = False) -> None:
    """Make ``cls`` available as ``provider: {name: {...}}`` in configs; takes precedence over all else."""
    provider_registry.register(name, cls, replace=replace)


def register_middleware(name: str, cls: Any, *, replace: bool = False) -> None:
    """Make ``cls`` (a ``ProviderMiddleware``) available by ``name`` in a config's middleware list."""
    middleware_registry.register(name, cls, replace=replace)
