"""Stacks from configuration: ``load_config``, ``resolve_config`` and ``build_provider``.

Everything is validated before anything is constructed: unknown keys, wrong types, numbers out of
range (NaN and infinities included) and unknown exception names raise one ``ConfigError`` listing
every problem, each naming the file, the entry, the option and what is allowed.

A configuration is trusted input, like code: a dotted exception name in ``on:`` (``mypkg.errors.X``)
imports its module while the config is checked, which runs that module's code. Names of this
package's errors and builtins import nothing. Never load a configuration an untrusted party wrote.
"""

from __future__ import annotations

import builtins
import collections.abc
import importlib
import inspect
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ._bounds import Bound, bounds_of
from ._core import Middleware, ProviderMiddleware, stack
from ._errors import PUBLIC, ConfigError, SandboxError
from ._protocol import SandboxProvider
from ._registry import middleware_registry, provider_registry
from .middleware._retry import RetryOn

__all__ = ["ResolvedLayer", "ResolvedStack", "build_provider", "load_config", "resolve_config"]

_INJECTED = ("meter_provider", "tracer_provider")


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
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'provider' and 'middleware', got {type(data).__name__}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's complaint with the line and column in the file (PyYAML names the string it parsed)."""
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part)
    if mark is None or not what:
        return str(exc).replace("<unicode string>", "the file")
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


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
        provider: SandboxProvider | None = None,
    ) -> SandboxProvider:
        """Construct the stack with ``stack()``; telemetry providers reach the layers that accept them.

        ``provider``: this config's provider, already constructed (by default it is constructed here).
        """
        if provider is None:
            provider = self.provider.cls(**self.provider.options)
        if wrap_provider is not None:
            provider = wrap_provider(provider)
        injected = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
        middleware = []
        for layer in self.middleware:
            accepted = inspect.signature(layer.cls).parameters
            extra = {key: value for key, value in injected.items() if value is not None and key in accepted}
            middleware.append(Middleware(layer.cls, **layer.options, **extra))
        return stack(provider, middleware)


def build_provider(
    config: Mapping[str, Any],
    *,
    meter_provider: Any = None,
    tracer_provider: Any = None,
    source: str | Path | None = None,
) -> SandboxProvider:
    """Validate ``config`` and build its stack (first middleware entry outermost)."""
    return resolve_config(config, source=source).build(meter_provider=meter_provider, tracer_provider=tracer_provider)


class _Problems:
    """Every problem found in one config, each line prefixed with where the config came from."""

    def __init__(self, source: str | None) -> None:
        self.prefix = f"{source}: " if source else ""
        self.lines: list[str] = []

    def add(self, problem: str) -> None:
        self.lines.append(self.prefix + problem)

    def extend(self, error: ConfigError) -> None:
        for problem in error.problems:
            self.add(problem)

    def raise_any(self) -> None:
        if self.lines:
            raise ConfigError(*self.lines)


def resolve_config(config: Mapping[str, Any], *, source: str | Path | None = None) -> ResolvedStack:
    """Validate ``config`` completely, constructing nothing; ``ConfigError`` lists every problem.

    ``source`` (e.g. the file the config came from) starts every problem's line.
    """
    problems = _Problems(str(source) if source is not None else None)
    if not isinstance(config, Mapping):
        problems.add(f"a config is a mapping with 'provider' and 'middleware', not {type(config).__name__}")
        problems.raise_any()
    unknown = set(config) - {"provider", "middleware"}
    if unknown:
        problems.add(f"unknown top-level key(s) {sorted(unknown, key=str)}; allowed: ['middleware', 'provider']")
    provider = None
    if "provider" not in config:
        problems.add("the config has no 'provider'; e.g. provider: {local: {isolation: none}}")
    else:
        provider = _resolve_entry(problems, "provider", config["provider"], is_middleware=False)
    entries = config.get("middleware") or []
    if not isinstance(entries, list):
        problems.add(f"middleware: expected a list (first entry outermost), got {type(entries).__name__}")
        entries = []
    layers = [
        _resolve_entry(problems, f"middleware[{index}]", entry, is_middleware=True)
        for index, entry in enumerate(entries)
    ]
    problems.raise_any()
    assert provider is not None and all(layer is not None for layer in layers)  # else a problem was raised
    return ResolvedStack(provider, [layer for layer in layers if layer is not None])


def _resolve_entry(problems: _Problems, where: str, entry: Any, *, is_middleware: bool) -> ResolvedLayer | None:
    try:
        name, options = _single_entry(where, entry)
        registry = middleware_registry if is_middleware else provider_registry
        try:
            cls = registry.get(name)
        except SandboxError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    except ConfigError as exc:
        problems.extend(exc)
        return None
    if is_middleware:
        where = f"{where} ({name})"
        if not (isinstance(cls, type) and issubclass(cls, ProviderMiddleware)):
            problems.add(f"{where}: {cls!r} is not a ProviderMiddleware subclass")
            return None
    else:
        where = f"provider {name!r}"
    before = len(problems.lines)
    converted = _validate(problems, where, cls, options, first_is_inner=is_middleware)
    return ResolvedLayer(name, cls, converted) if len(problems.lines) == before else None


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


def _validate(
    problems: _Problems, where: str, cls: Any, options: Mapping[str, Any], *, first_is_inner: bool, path: str = ""
) -> dict[str, Any]:
    """``options`` checked against ``cls``'s signature and its ``BOUNDS``; one problem per bad option.

    ``path`` names the option these options are nested in (``budget.``).
    """
    parameters = list(inspect.signature(cls).parameters.values())
    if first_is_inner:
        parameters = parameters[1:]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an unresolvable annotation: check names only
        hints = {}
    bounds = bounds_of(cls)
    allowed = {p.name: p for p in parameters if p.name not in _INJECTED and p.kind is not p.VAR_KEYWORD}
    converted: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            hint = " (YAML 1.1 reads a bare on/off/yes/no as a boolean: use load_config, or quote the key)"
            problems.add(f"{where}: option names must be strings, got {key!r}{hint}")
        elif key in _INJECTED:
            problems.add(f"{where}: {key!r} cannot be set in a config; it is passed to build() by the program")
        elif key not in allowed:
            allowed_names = ", ".join(path + name for name in sorted(allowed)) or "none"
            problems.add(f"{where}: unknown option {path + key!r}; allowed: {allowed_names}")
        else:
            try:
                converted[key] = _convert(where, path + key, value, hints.get(key, Any), bounds.get(key))
            except ConfigError as exc:
                problems.extend(exc)
    missing = [
        n for n, p in allowed.items() if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and n not in options
    ]
    if missing:
        problems.add(f"{where}: missing required option(s) {missing}")
    return converted


def _convert(entry: str, name: str, value: Any, hint: Any, bound: Bound | None) -> Any:
    where = f"{entry}: option {name!r}"
    if hint == RetryOn:
        return _exceptions(where, value)
    if isinstance(value, Mapping) and _is_options_class(_strip_none(hint)):
        return _build_value(entry, name, _strip_none(hint), value)
    if not _conforms(value, hint):
        raise ConfigError(f"{where} must be {_describe(hint)}, not {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        no_limit = " (null means no limit)" if _conforms(None, hint) else ""
        raise ConfigError(f"{where} must be a finite number, not {value!r}{no_limit}")
    problem = bound.problem(value) if bound is not None else None
    if problem is not None:
        raise ConfigError(f"{where} {problem}")
    return value


def _is_options_class(hint: Any) -> bool:
    """An option annotated with a class of our own making (e.g. ``RetryBudget``) is given as its options."""
    return isinstance(hint, type) and hint.__module__ != "builtins" and not issubclass(hint, Path | Mapping)


def _build_value(entry: str, name: str, cls: type, options: Mapping[str, Any]) -> Any:
    problems = _Problems(None)
    converted = _validate(problems, entry, cls, options, first_is_inner=False, path=f"{name}.")
    problems.raise_any()
    try:
        return cls(**converted)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{entry}: option {name!r}: {exc}") from exc


def _exceptions(where: str, value: Any) -> tuple[type[Exception], ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{where} must be an exception name or a list of them, e.g. [SandboxCreateError, ConnectionError]"
        )
    return tuple(_exception(where, name) for name in names)


def _exception(where: str, name: str) -> type[Exception]:
    """The exception class ``name`` names; a dotted name imports its module (trusted input only)."""
    found: Any = None
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            found = None
    else:
        found = PUBLIC.get(name) or getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    raise ConfigError(
        f"{where}: unknown exception {name!r}; use one of this package's ({', '.join(sorted(PUBLIC))}), a builtin "
        "such as ConnectionError or TimeoutError, or a dotted path like mypkg.errors.RateLimited"
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
