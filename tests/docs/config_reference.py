"""The reference tables of ``docs/config-and-cli.md``, made from what the program knows: every built-in
provider and layer of the registries (``sandbox_middleware/_registry.py``), every option of each (its
constructor's parameters, as the config validator reads them), its type, default and ``BOUNDS``; and every
option of each ``sandbox-middleware`` command (its argparse parser).

``tests/docs/test_config_reference.py`` fails when the page's tables differ from these;
``python -m tests.docs.config_reference`` writes them into the page.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandbox_middleware._bounds import bounds_of
from sandbox_middleware._config import RetryOn  # where the config validator reads it
from sandbox_middleware._registry import Registry, middleware_registry, provider_registry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-and-cli.md"
BEGIN = "<!-- reference tables: made by python -m tests.docs.config_reference; checked by tests/docs -->"
END = "<!-- end of the reference tables -->"
INJECTED = ("meter_provider", "tracer_provider")  # given by the program, never by a config

# Where each entry is explained (the tables give names, types, defaults and bounds only).
PAGES = {
    "local": "[LocalProvider](local-provider.md)",
    "docker": "[DockerProvider](docker-provider.md)",
    "tracing": "[Telemetry](telemetry.md)",
    "metrics": "[Telemetry](telemetry.md)",
    "release_accounting": "[Telemetry](telemetry.md)",
    "retry": "[Retries](retries.md)",
    "ownership": "[Ownership and reaping](scale-out.md#ownership-and-reaping)",
    "admission": "[Admission and warm pools](admission-and-pools.md)",
    "warm_pool": "[Admission and warm pools](admission-and-pools.md)",
}


def builtins(registry: Registry) -> list[str]:
    """The registry's own names (not another distribution's entry points, not NeMo Gym's)."""
    return [name for name in registry.names() if registry.origin(name).startswith("built-in")]


def options(cls: Any, *, first_is_inner: bool, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(option, type, default, accepts) of each config option of ``cls``; an option whose type is an
    options class of this package (``budget: RetryBudget``) is followed by that class's options."""
    parameters = list(inspect.signature(cls).parameters.values())[1 if first_is_inner else 0 :]
    hints = typing.get_type_hints(cls.__init__)
    bounds = bounds_of(cls)
    for parameter in parameters:
        if parameter.name in INJECTED or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        hint = hints.get(parameter.name, Any)
        default = "required" if parameter.default is parameter.empty else _yaml(parameter.default)
        bound = bounds.get(parameter.name)
        accepts = "" if bound is None else str(bound) + (" (null: no limit)" if bound.optional else "")
        yield f"{prefix}{parameter.name}", _type(hint), default, accepts
        nested = _options_class(hint)
        if nested is not None:
            yield from options(nested, first_is_inner=False, prefix=f"{prefix}{parameter.name}.")


def _options_class(hint: Any) -> type | None:
    """The class an option is given as the options of (``RetryBudget | None``), as the validator reads it."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    classes = [arg for arg in (typing.get_args(hint) if union else (hint,)) if arg is not type(None)]
    if len(classes) == 1 and isinstance(classes[0], type) and classes[0].__module__.startswith("sandbox_middleware"):
        return classes[0]
    return None


def _type(hint: Any) -> str:
    if hint is RetryOn:
        return "list of exception names"
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in typing.get_args(hint))
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type(arg) for arg in args if arg is not int or float not in args))
    if hint is type(None):
        return "null"
    if args:
        return f"list of {_type(args[0])}"
    return {"str": "string", "float": "number", "int": "whole number", "bool": "true or false"}.get(
        getattr(hint, "__name__", str(hint)), getattr(hint, "__name__", str(hint))
    )


def _yaml(value: Any) -> str:
    if isinstance(value, tuple | list | frozenset | set):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, str | int | float | bool) or value is None:
        return json.dumps(value)
    return repr(value)


def _rows(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    cells = [header, tuple("---" for _ in header), *rows]
    return ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells]


def config_tables() -> list[str]:
    lines: list[str] = []
    for kind, registry, first_is_inner in (
        ("provider", provider_registry, False),
        ("middleware", middleware_registry, True),
    ):
        for name in builtins(registry):
            cls = registry.get(name)
            entry = f"provider: {{{name}: {{...}}}}" if kind == "provider" else f"{name}"
            lines += [f"#### `{entry}`: `{cls.__name__}` ({PAGES.get(name, 'no page yet')})", ""]
            found = [
                (f"`{o}`", t, f"`{d}`" if d != "required" else d, a)
                for o, t, d, a in options(cls, first_is_inner=first_is_inner)
            ]
            lines += _rows(found, ("option", "type", "default", "accepts")) if found else ["No options."]
            lines.append("")
    return lines


def command_tables() -> list[str]:
    from sandbox_middleware.cli._main import _parser

    parser = _parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    lines: list[str] = []
    for name, command in commands.choices.items():
        rows = []
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(action.option_strings) or action.dest.upper()
            default = (
                ""
                if action.default is None or action.default is False or action.default == ""
                else f"`{action.default}`"
            )
            rows.append((f"`{flag}`", default, " ".join((action.help or "").split()).replace("%%", "%")))
        lines += [f"#### `sandbox-middleware {name}`", "", *_rows(rows, ("argument", "default", "what it does")), ""]
    return lines


def tables() -> str:
    """The generated part of the page, markers included."""
    body = ["### Providers and layers", "", *config_tables(), "### Command-line arguments", "", *command_tables()]
    return "\n".join([BEGIN, "", *body, END])


def page_tables(text: str) -> str:
    """The generated part of the page's text, markers included (empty if it has none)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def main() -> int:
    text = PAGE.read_text()
    current = page_tables(text)
    if not current:
        print(f"{PAGE}: no {BEGIN!r} ... {END!r} markers to write between", file=sys.stderr)
        return 1
    PAGE.write_text(text.replace(current, tables()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
