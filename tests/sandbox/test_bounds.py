"""Bounds declared beside the parameters (``BOUNDS``) are the config's and the constructors' alike:
a value one refuses the other refuses, with the same words, and every numeric option has one."""

from __future__ import annotations

import inspect
import math
import typing
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_middleware import ConfigError, LocalProvider, RetryBudget, SandboxArgumentError, resolve_config
from sandbox_middleware._bounds import Bound, Bounds, bounds_of
from sandbox_middleware._registry import middleware_registry
from tests.providers import PlainProvider

# Every value a user might write: wrong types, non-finite numbers, each side of every bound.
CANDIDATES: list[Any] = [None, True, "1", math.nan, math.inf, -math.inf, -1, -0.5, 0, 0.0, 0.5, 1, 1.5, 2, 10**9]

BOUNDED_MIDDLEWARE = [name for name in middleware_registry.names() if bounds_of(middleware_registry.get(name))]


def _numeric(hint: Any) -> tuple[bool, bool]:
    """(is the option a number, does it allow None) from its annotation."""
    args = typing.get_args(hint) or (hint,)
    return any(a in (int, float) for a in args), type(None) in args


def _config_problem(config: dict[str, Any]) -> str | None:
    try:
        resolve_config(config)
    except ConfigError as exc:
        [problem] = exc.problems
        return problem
    return None


def _constructor_problem(build: Any) -> str | None:
    try:
        build()
    except SandboxArgumentError as exc:
        return str(exc)
    return None


def _agree(config_problem: str | None, constructor_problem: str | None, owner: str, name: str, value: Any) -> None:
    assert (config_problem is None) == (constructor_problem is None), (name, value, config_problem, constructor_problem)
    if constructor_problem is not None and config_problem is not None and constructor_problem.startswith(owner):
        why = constructor_problem.removeprefix(f"{owner}: {name} ")
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if numeric:  # a number of the right type: both say exactly why it is refused
            assert why in config_problem, (config_problem, why)


def test_the_bounded_middleware_are_the_ones_with_numeric_options() -> None:
    assert {"retry", "tracing", "release_accounting"} <= set(BOUNDED_MIDDLEWARE)


@pytest.mark.parametrize("owner", [*map(middleware_registry.get, BOUNDED_MIDDLEWARE), RetryBudget, LocalProvider])
def test_every_numeric_option_has_a_bound_that_matches_its_annotation(owner: Any) -> None:
    hints = typing.get_type_hints(owner.__init__)
    bounds = bounds_of(owner)
    for parameter in list(inspect.signature(owner).parameters.values()):
        numeric, optional = _numeric(hints.get(parameter.name))
        if numeric:
            assert parameter.name in bounds, f"{owner.__name__}.{parameter.name} has no bound"
            assert bounds[parameter.name].optional == optional, f"{owner.__name__}.{parameter.name}"
    assert set(bounds) <= set(inspect.signature(owner).parameters)


@pytest.mark.parametrize("layer", BOUNDED_MIDDLEWARE)
def test_config_and_constructor_refuse_the_same_values(layer: str) -> None:
    cls = middleware_registry.get(layer)
    bounds = bounds_of(cls)
    assert isinstance(bounds, Bounds)
    for name in bounds:
        for value in CANDIDATES:
            config = {"provider": "local", "middleware": [{layer: {name: value}}]}
            problem = _config_problem(config)
            refused = _constructor_problem(lambda: cls(PlainProvider(), **{name: value}))  # noqa: B023
            _agree(problem, refused, bounds.owner, name, value)


def test_the_nested_retry_budget_agrees_too() -> None:
    bounds = bounds_of(RetryBudget)
    assert isinstance(bounds, Bounds)
    for name in bounds:
        for value in CANDIDATES:
            problem = _config_problem({"provider": "local", "middleware": [{"retry": {"budget": {name: value}}}]})
            refused = _constructor_problem(lambda: RetryBudget(**{name: value}))  # noqa: B023
            _agree(problem, refused, bounds.owner, name, value)


def test_the_local_provider_agrees_too(tmp_path: Path) -> None:
    """Limits, output and transfer sizes and the sandbox uid: a config refuses them before anything is built."""
    bounds = bounds_of(LocalProvider)
    assert {"memory_mib", "pids", "cpu", "disk_gib", "max_output_bytes", "sandbox_uid"} <= set(bounds)
    for name in bounds:
        for value in CANDIDATES:
            problem = _config_problem({"provider": {"local": {"isolation": "none", name: value}}})
            built: list[LocalProvider] = []
            refused = _constructor_problem(
                lambda: built.append(LocalProvider(isolation="none", base_dir=tmp_path, **{name: value}))  # noqa: B023
            )
            for provider in built:
                anyio.run(provider.aclose)
            _agree(problem, refused, bounds.owner, name, value)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"wait_initial": math.nan}, "RetryMiddleware: wait_initial must be a finite number, not nan"),
     ({"attempt_timeout": math.nan},
      "RetryMiddleware: attempt_timeout must be a finite number, not nan (null means no limit)"),
     ({"attempts": 0}, "RetryMiddleware: attempts must be >= 1, not 0"),
     ({"timeout": -1}, "RetryMiddleware: timeout must be > 0, not -1"),
     ({"wait_max": math.inf}, "RetryMiddleware: wait_max must be a finite number, not inf")],
)  # fmt: skip
def test_constructor_errors_are_typed_and_name_the_option(options: dict[str, Any], message: str) -> None:
    """The retry layer built in Python refuses what the config refuses (it used to accept a NaN wait and
    then wait past its timeout, and fail on ``attempt_timeout=nan`` later with an untyped ValueError)."""
    from sandbox_middleware import RetryMiddleware

    with pytest.raises(SandboxArgumentError) as info:
        RetryMiddleware(PlainProvider(), **options)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_a_bound_describes_itself() -> None:
    assert str(Bound(0, strict=True)) == "> 0"
    assert str(Bound(1, whole=True).at_most(4096)) == ">= 1 and <= 4096"
    assert Bound(0).problem(True) == "must be float, not True (bool)"
    assert Bound(0, whole=True).problem(2.0) == "must be int, not 2.0 (float)"
    assert Bound(0, whole=True).or_none().problem(math.nan) == "must be int or null, not nan (float)"
    assert Bound(0).or_none().problem(None) is None
    assert Bound(0).problem(None) == "must be float, not None (NoneType)"
    assert Bound(0).or_none().problem(math.inf) == "must be a finite number, not inf (null means no limit)"
    assert Bound(0, strict=True).at_most(10).problem(10.5) == "must be > 0 and <= 10, not 10.5"


def test_a_bound_reads_as_a_person_writes_it() -> None:
    from sandbox_middleware._bounds import AT_LEAST_ONE, POSITIVE

    assert str(AT_LEAST_ONE.at_most(16_777_216)) == ">= 1 and <= 16777216"
    assert str(POSITIVE.at_most(0.25)) == "> 0 and <= 0.25"
