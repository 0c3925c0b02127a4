"""Stacks from configuration: ``load_config``, ``resolve_config`` and ``build_provider``.

Everything is validated before anything is constructed: unknown keys, wrong types and unknown
exception names raise ``ConfigError`` naming the entry, the key and what is allowed.
"""

from __future__ import annotations

import builtins
import collections.abc
import importlib
import inspect
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ._budget import RetryBudget
from ._core import ProviderMiddleware
from ._protocol import SandboxError, SandboxProvider
from ._registry import middleware_registry, provider_registry
from ._retry import RetryOn

__all__ = ["ConfigError", "ResolvedLayer", "ResolvedStack", "build_provider", "load_config", "resolve_config"]

_INJECTED = ("meter_provider", "tracer_provider")


class ConfigError(SandboxError):
    """A configuration that cannot be built; the message names the entry, the key and what is allowed."""


ConfigError.__module__ = "sandbox_middleware"


class _Loader(yaml.SafeLoader):
    """YAML with 1.2 booleans: only true/false, so the retry option ``on:`` stays the string "on"."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML stack configuration (``provider:`` and ``middleware:``).

    Booleans are YAML 1.2's (``true``/``false``): ``on``, ``off``, ``yes`` and ``no`` stay strings.
    """
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'provider' and 'middleware', got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ResolvedLayer:
    """One validated stack entry: its config name, class and converted options."""

    name: str
    cls: Any
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        options = ", ".join(f"{key}={_show(value)}" for key, value in self.options.items())
        return f"{self.name} -> {getattr(self.cls, '__qualname__', self.cls)}({options})"


@dataclass(frozen=True)
class ResolvedStack:
    """A validated configuration; ``build()`` constructs it."""

    provider: ResolvedLayer
    middleware: list[ResolvedLayer]

    def describe(self) -> str:
        lines = [f"provider: {self.provider.describe()}  [{provider_registry.origin(self.provider.name)}]"]
        lines.append("middleware, outermost first:" if self.middleware else "middleware: none")
        for number, layer in enumerate(self.middleware, start=1):
            lines.append(f"  {number}. {layer.describe()}  [{middleware_registry.origin(layer.name)}]")
        return "\n".join(lines)

    def build(
        self,
        *,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        wrap_provider: typing.Callable[[SandboxProvider], SandboxProvider] | None = None,
    ) -> SandboxProvider:
        """Construct the stack; telemetry providers are passed to the layers that accept them."""  # fmt: skip
        provider: SandboxProvider = self.provider.cls(**self.provider.options)
        if wrap_provider is not None:
            provider = wrap_provider(provider)
        injected = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
        for layer in reversed(self.middleware):
            accepted = inspect.signature(layer.cls).parameters
            extra = {key: value for key, value in injected.items() if value is not None and key in accepted}
            provider = layer.cls(provider, **layer.options, **extra)
        return provider


def build_provider(
    config: Mapping[str, Any], *, meter_provider: Any = None, tracer_provider: Any = None
) -> SandboxProvider:
    """Validate ``config`` and build its stack (first middleware entry outermost)."""
    return resolve_config(config).build(meter_provider=meter_provider, tracer_provider=tracer_provider)


def resolve_config(config: Mapping[str, Any]) -> ResolvedStack:
    """Validate ``config`` completely, constructing nothing."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config is a mapping with 'provider' and 'middleware', not {type(config).__name__}")
    unknown = set(config) - {"provider", "middleware"}
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {sorted(unknown)}; allowed: ['middleware', 'provider']")
    if "provider" not in config:
        raise ConfigError("the config has no 'provider'; e.g. provider: {local: {isolation: none}}")
    name, options = _single_entry("provider", config["provider"])
    try:
        provider_cls = provider_registry.get(name)
    except SandboxError as exc:
        raise ConfigError(f"provider: {exc}") from exc
    provider = ResolvedLayer(
        name, provider_cls, _validate(f"provider {name!r}", provider_cls, options, first_is_inner=False)
    )
    entries = config.get("middleware") or []
    if not isinstance(entries, list):
        raise ConfigError(f"middleware: expected a list (first entry outermost), got {type(entries).__name__}")
    layers = []
    for index, entry in enumerate(entries):
        where = f"middleware[{index}]"
        name, options = _single_entry(where, entry)
        try:
            cls = middleware_registry.get(name)
        except SandboxError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, ProviderMiddleware)):
            raise ConfigError(f"{where} ({name}): {cls!r} is not a ProviderMiddleware subclass")
        layers.append(ResolvedLayer(name, cls, _validate(f"{where} ({name})", cls, options, first_is_inner=True)))
    return ResolvedStack(provider, layers)


def _single_entry(where: str, entry: Any) -> tuple[str, Mapping[str, Any]]:
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, Mapping) and len(entry) == 1:
        [(name, options)] = entry.items()
        if options is None:
            options = {}
        if not isinstance(name, str) or not isinstance(options, Mapping):
            raise ConfigError(f"{where}: expected 'name' or {{name: {{option: value}}}}, got {entry!r}")
        return name, options
    raise ConfigError(f"{where}: expected 'name' or {{name: {{option: value}}}} (one key), got {entry!r}")


def _validate(where: str, cls: Any, options: Mapping[str, Any], *, first_is_inner: bool) -> dict[str, Any]:
    parameters = list(inspect.signature(cls).parameters.values())
    if first_is_inner:
        parameters = parameters[1:]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an unresolvable annotation: check names only
        hints = {}
    allowed = {p.name: p for p in parameters if p.name not in _INJECTED and p.kind is not p.VAR_KEYWORD}
    converted: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            hint = " (YAML 1.1 reads a bare on/off/yes/no as a boolean: use load_config, or quote the key)"
            raise ConfigError(f"{where}: option names must be strings, got {key!r}{hint}")
        if key in _INJECTED:
            raise ConfigError(f"{where}: {key!r} cannot be set in a config; it is passed to build() by the program")
        if key not in allowed:
            raise ConfigError(f"{where}: unknown option {key!r}; allowed: {', '.join(sorted(allowed)) or 'none'}")
        hint = hints.get(key, Any)
        converted[key] = _convert(f"{where}: option {key!r}", value, hint)
    missing = [
        n for n, p in allowed.items() if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and n not in options
    ]
    if missing:
        raise ConfigError(f"{where}: missing required option(s) {missing}")
    return converted


def _convert(where: str, value: Any, hint: Any) -> Any:
    if hint == RetryOn:
        return _exceptions(where, value)
    if _strip_none(hint) is RetryBudget and isinstance(value, Mapping):
        try:
            return RetryBudget(**value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}; expected {{max_tokens: 100, token_ratio: 0.1}}") from exc
    if not _conforms(value, hint):
        raise ConfigError(f"{where} must be {_describe(hint)}, not {value!r} ({type(value).__name__})")
    return value


def _exceptions(where: str, value: Any) -> tuple[type[Exception], ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{where} must be an exception name or a list of them, e.g. [SandboxCreateError, ConnectionError]"
        )
    return tuple(_exception(where, name) for name in names)


def _exception(where: str, name: str) -> type[Exception]:
    import sandbox_middleware

    found: Any = None
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            found = None
    else:
        found = getattr(sandbox_middleware, name, None) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    ours = sorted(n for n in dir(sandbox_middleware) if n.endswith("Error"))
    raise ConfigError(
        f"{where}: unknown exception {name!r}; use one of this package's ({', '.join(ours)}), a builtin such as "
        "ConnectionError or TimeoutError, or a dotted path like mypkg.errors.RateLimited"
    )


def _strip_none(hint: Any) -> Any:
    args = typing.get_args(hint)
    if _is_union(hint) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _conforms(value: Any, hint: Any) -> bool:
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if _is_union(hint):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is Path:
        return isinstance(value, str | Path)
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.Collection, collections.abc.Iterable):
        if not isinstance(value, list | tuple):
            return False
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return not args or all(_conforms(item, args[0]) for item in value)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            return False
        key_value = typing.get_args(hint)
        return not key_value or all(_conforms(k, key_value[0]) and _conforms(v, key_value[1]) for k, v in value.items())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this checker does not model (a callable, a protocol): let the class decide


def _describe(hint: Any) -> str:
    if _is_union(hint):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint)).replace("Collection", "a list").replace("Sequence", "a list")


def _show(value: Any) -> str:
    if isinstance(value, tuple) and all(isinstance(v, type) for v in value):
        return "(" + ", ".join(v.__name__ for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)
