"""docs/config-and-cli.md's reference tables are the registry's, the constructors' and the parsers': every
built-in provider and layer, every option with its type, default and bounds, every command-line argument."""

from __future__ import annotations

import re

from sandbox_middleware._bounds import bounds_of
from sandbox_middleware._registry import middleware_registry, provider_registry
from tests.docs.config_reference import BEGIN, END, PAGE, builtins, options, page_tables, tables


def test_the_page_holds_the_tables_made_from_what_the_program_knows() -> None:
    current = page_tables(PAGE.read_text())
    assert current, f"{PAGE.name} lost its {BEGIN!r} ... {END!r} markers"
    assert current == tables(), (
        f"{PAGE.name}'s reference tables differ from the registry, the constructors' options and BOUNDS, or the "
        "command-line parsers: run python -m tests.docs.config_reference to rewrite them"
    )


def test_every_entry_and_option_is_in_a_table_and_every_table_row_exists() -> None:
    """Read back from the page: the entries and options it names are exactly the program's, both ways, and
    each bounded option shows its bound."""
    text = page_tables(PAGE.read_text())
    named: dict[str, dict[str, str]] = {}
    for section in re.split(r"^#### ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        entry = re.match(r"`(?:provider: \{(\w+): \{\.\.\.\}\}|(\w+))`: `\w+`", title)
        if entry is None:
            continue  # a command's table
        rows = re.findall(r"^\| `([\w.]+)` \| .*? \| .*? \| (.*?) \|$", body, flags=re.MULTILINE)
        named[entry.group(1) or entry.group(2)] = dict(rows)
    known = {
        **{name: (provider_registry.get(name), False) for name in builtins(provider_registry)},
        **{name: (middleware_registry.get(name), True) for name in builtins(middleware_registry)},
    }
    assert sorted(named) == sorted(known)
    assert {"local", "docker", "admission", "warm_pool"} <= set(named)
    for name, (cls, first_is_inner) in known.items():
        assert set(named[name]) == {option for option, *_ in options(cls, first_is_inner=first_is_inner)}, name
        for option, bound in bounds_of(cls).items():
            assert named[name][option].startswith(str(bound)), (name, option, named[name][option])
    assert "max_age_s" in named["warm_pool"] and "max_create_rate" in named["admission"]


def test_every_command_line_argument_is_in_a_table() -> None:
    import argparse

    from sandbox_middleware.cli._main import _parser

    text = page_tables(PAGE.read_text())
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        section = text.split(f"#### `sandbox-middleware {name}`", 1)[1].split("####", 1)[0]
        for action in command._actions:
            for flag in action.option_strings or [action.dest.upper()]:
                if flag not in ("-h", "--help"):
                    assert flag in section, (name, flag)
