"""Stacks from config: round trips, one clear error per bad config, and the registries."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_middleware import (
    ConfigError,
    LocalProvider,
    MetricsMiddleware,
    RegistryError,
    ReleaseAccountingMiddleware,
    RetryBudget,
    RetryMiddleware,
    SandboxCreateError,
    TracingMiddleware,
    build_provider,
    load_config,
    recommended_middleware,
    register_provider,
    resolve_config,
    stack,
)
from sandbox_middleware._registry import Registry, middleware_registry, provider_registry
from sandbox_middleware.testing import FaultInjectingProvider, InjectedFault
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.providers import PlainProvider

FULL = textwrap.dedent(
    """
    provider:
      local: {isolation: none, base_dir: BASE_DIR}
    middleware:            # first entry is the outermost
      - tracing: {record_command: true, command_max_length: 64}
      - metrics
      - release_accounting: {release_on_aclose: true, release_timeout_s: 5, release_concurrency: 4}
      - retry:
          attempts: 5
          timeout: 300
          wait_initial: 0.1
          wait_max: 2
          wait_jitter: 0.5
          attempt_timeout: 30
          operations: [create, close]
          on: [SandboxCreateError, ConnectionError, builtins.TimeoutError, sandbox_middleware.testing.InjectedFault]
          budget: {max_tokens: 50, token_ratio: 0.2}
    """
)


def test_round_trip_every_middleware_and_option(tmp_path: Path, telemetry: TelemetryCapture) -> None:
    """Every built-in middleware and option in YAML builds the stack it describes, outermost first."""
    path = tmp_path / "stack.yaml"
    path.write_text(FULL.replace("BASE_DIR", str(tmp_path / "boxes")))
    provider: Any = build_provider(
        load_config(path), meter_provider=telemetry.meter_provider, tracer_provider=telemetry.tracer_provider
    )
    layers = []
    while hasattr(provider, "inner"):
        layers.append(provider)
        provider = provider.inner
    expected = [TracingMiddleware, MetricsMiddleware, ReleaseAccountingMiddleware, RetryMiddleware]
    assert len(layers) == len(expected)
    assert all(isinstance(layer, cls) for layer, cls in zip(layers, expected, strict=True))
    tracing, metrics, accounting, retry = layers
    assert isinstance(provider, LocalProvider) and provider.isolation == "none"
    assert tracing.record_command is True and tracing.command_max_length == 64
    assert tracing._tracing._provider is telemetry.tracer_provider
    assert metrics._instruments._provider is telemetry.meter_provider
    assert accounting.release_on_aclose is True and accounting.release_timeout_s == 5
    assert accounting.release_concurrency == 4
    assert retry.attempts == 5 and retry.timeout == 300 and retry.attempt_timeout == 30
    assert (retry.wait_initial, retry.wait_max, retry.wait_jitter) == (0.1, 2, 0.5)
    assert retry.operations == {"create", "close"}
    assert retry.on == (SandboxCreateError, ConnectionError, TimeoutError, InjectedFault)
    assert isinstance(retry.budget, RetryBudget) and retry.budget.max_tokens == 50
    assert retry.budget.token_ratio == 0.2


def test_check_describes_outermost_first(tmp_path: Path) -> None:
    """The resolved stack reads outermost first, with options and origins."""
    path = tmp_path / "stack.yaml"
    path.write_text(FULL.replace("BASE_DIR", str(tmp_path / "boxes")))
    text = resolve_config(load_config(path)).describe()
    lines = text.splitlines()
    assert lines[0].startswith("provider: local -> LocalProvider(isolation='none'")
    assert [line.split(" -> ")[0].strip() for line in lines[2:]] == [
        "1. tracing",
        "2. metrics",
        "3. release_accounting",
        "4. retry",
    ]
    assert "on=(SandboxCreateError, ConnectionError, TimeoutError, InjectedFault)" in text


class Recorded:
    """A provider that records being constructed, to show a bad config starts nothing."""

    built = 0
    name = "recorded"

    def __init__(self, *, size: int = 1) -> None:
        type(self).built += 1


BAD = [
    ({"provider": "recorded", "middleware": ["tracing", {"retry": {"attempts": 2, "tries": 3}}]},
     r"middleware\[1\] \(retry\): unknown option 'tries'; allowed: attempt_timeout, attempts, budget"),
    ({"provider": "recorded", "middleware": [{"retry": {"attempts": "five"}}]},
     r"middleware\[0\] \(retry\): option 'attempts' must be int or null, not 'five'"),
    ({"provider": "recorded", "middleware": [{"retry": {"on": ["SandboxCreateErr"]}}]},
     r"middleware\[0\] \(retry\): option 'on': unknown exception 'SandboxCreateErr'; use one of .*SandboxCreateError"),
    ({"provider": "recorded", "middleware": [{"tracing": {"record_command": "yes"}}]},
     r"option 'record_command' must be bool"),
    ({"provider": "recorded", "middleware": [{"metrics": {"meter_provider": "x"}}]},
     r"'meter_provider' cannot be set in a config"),
    ({"provider": "recorded", "middleware": ["tracin"]},
     r"middleware\[0\]: unknown middleware 'tracin'; available: .*metrics.*tracing"),
    ({"provider": "nosuch"}, r"provider: unknown provider 'nosuch'; available: .*local"),
    ({"provider": {"recorded": {"size": "big"}}}, r"provider 'recorded': option 'size' must be int"),
    ({"provider": {"local": {"isolation": "docker"}}}, r"option 'isolation' must be one of 'none', 'bwrap'"),
    ({"provider": "recorded", "middleware": "tracing"}, r"middleware: expected a list"),
    ({"provider": "recorded", "middleware": [{"tracing": {}, "metrics": {}}]}, r"middleware\[0\]: expected 'name'"),
    ({"middleware": []}, r"the config has no 'provider'"),
    ({"provider": "recorded", "extras": 1}, r"unknown top-level key\(s\) \['extras'\]"),
    ({"provider": "recorded", "middleware": [{"retry": {"budget": {"max_tokens": -1}}}]},
     r"'budget.max_tokens' must be > 0, not -1"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_each_bad_config_has_its_own_error(config: dict[str, Any], message: str) -> None:
    """A bad config raises ConfigError naming the entry, the key and what is allowed; nothing is built."""
    register_provider("recorded", Recorded, replace=True)
    Recorded.built = 0
    with pytest.raises(ConfigError, match=message):
        build_provider(config)
    assert Recorded.built == 0


def test_bad_yaml_and_files(tmp_path: Path) -> None:
    """Unreadable files, invalid YAML and a non-mapping document are clear errors naming the file."""
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("provider: [unclosed")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML: line 1, column 20: .*expected ',' or ']'"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- local")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


# -- numbers: type, finiteness and range from one declaration, check == run ---------------------

NAN, INF = float("nan"), float("inf")
NUMBERS = [
    ("retry", "attempts", 0, "must be >= 1, not 0"),
    ("retry", "attempts", -3, "must be >= 1, not -3"),
    ("retry", "attempts", NAN, "must be int or null, not nan (float)"),
    ("retry", "timeout", 0, "must be > 0, not 0"),
    ("retry", "timeout", INF, "must be a finite number, not inf (null means no limit)"),
    ("retry", "timeout", NAN, "must be a finite number, not nan (null means no limit)"),
    ("retry", "attempt_timeout", NAN, "must be a finite number, not nan (null means no limit)"),
    ("retry", "attempt_timeout", -1.5, "must be > 0, not -1.5"),
    ("retry", "wait_initial", NAN, "must be a finite number, not nan"),
    ("retry", "wait_max", -INF, "must be a finite number, not -inf"),
    ("retry", "wait_jitter", -0.1, "must be >= 0, not -0.1"),
    ("tracing", "command_max_length", -1, "must be >= 0, not -1"),
    ("release_accounting", "release_timeout_s", 0, "must be > 0, not 0"),
    ("release_accounting", "release_timeout_s", INF, "must be a finite number, not inf"),
    ("release_accounting", "release_concurrency", 0, "must be >= 1, not 0"),
]


@pytest.mark.parametrize(("entry", "option", "value", "message"), NUMBERS, ids=[f"{o}={v}" for _, o, v, _ in NUMBERS])
def test_each_bad_number_is_one_error(entry: str, option: str, value: float, message: str) -> None:
    """NaN, infinite, zero and negative values where invalid: exactly one error naming the file, entry and option."""
    config = {"provider": "local", "middleware": ["metrics", {entry: {option: value}}]}
    with pytest.raises(ConfigError) as info:
        resolve_config(config, source="stack.yaml")
    assert info.value.problems == [f"stack.yaml: middleware[1] ({entry}): option {option!r} {message}"]


@pytest.mark.parametrize(
    ("budget", "message"),
    [({"max_tokens": NAN}, "option 'budget.max_tokens' must be a finite number, not nan"),
     ({"token_ratio": 0}, "option 'budget.token_ratio' must be > 0, not 0"),
     ({"max_tokens": 1, "token_ratio": 5}, "option 'budget': RetryBudget: token_ratio must be in (0, max_tokens]"),
     ({"tokens": 5}, "unknown option 'budget.tokens'; allowed: budget.max_tokens, budget.token_ratio")],
)  # fmt: skip
def test_nested_options_are_checked_the_same_way(budget: dict[str, Any], message: str) -> None:
    """The retry budget's own options go through the same declaration, named by their dotted path."""
    with pytest.raises(ConfigError) as info:
        resolve_config({"provider": "local", "middleware": [{"retry": {"budget": budget}}]})
    assert len(info.value.problems) == 1 and message in info.value.problems[0]


def test_every_problem_is_listed_once() -> None:
    """All problems of a config come together, one line each, in the order of the file."""
    config = {
        "provider": {"local": {"isolation": "docker"}},
        "middleware": ["tracin", {"retry": {"attempts": 0, "timeout": NAN, "tries": 1}}],
    }
    with pytest.raises(ConfigError) as info:
        resolve_config(config)
    assert [problem.split(":")[0] for problem in info.value.problems] == [
        "provider 'local'", "middleware[0]", "middleware[1] (retry)", "middleware[1] (retry)", "middleware[1] (retry)"
    ]  # fmt: skip
    assert str(info.value) == "\n".join(info.value.problems)


PROBES = [NAN, INF, -INF, -1, 0, 0.5, 1, 3, True, "1", None]


@pytest.mark.parametrize(("entry", "option"), sorted({(e, o) for e, o, _, _ in NUMBERS}))
def test_whatever_check_accepts_builds(entry: str, option: str) -> None:
    """check accepts a value exactly when building the stack works with it: nothing passes check and fails run."""
    for value in PROBES:
        config = {"provider": "local", "middleware": [{entry: {option: value}}]}
        try:
            resolved = resolve_config(config)
        except ConfigError as exc:
            assert len(exc.problems) == 1, exc.problems
            continue
        assert not (isinstance(value, float) and not math.isfinite(value)), f"{option}={value} passed check"
        resolved.build()  # raises if the class refuses what check let through


def test_config_stack_is_the_hand_built_stack(telemetry: TelemetryCapture) -> None:
    """A config-built stack is what stack() builds from the same middleware by hand: same layers, same order."""
    config = {
        "provider": "local",
        "middleware": ["tracing", "metrics", "release_accounting", {"retry": {"attempts": 2}}],
    }
    from_config: Any = build_provider(config, meter_provider=telemetry.meter_provider)
    by_hand: Any = stack(
        LocalProvider(), recommended_middleware(meter_provider=telemetry.meter_provider, retry={"attempts": 2})
    )

    def layers(provider: Any) -> list[type]:
        found = [type(provider)]
        while hasattr(provider, "inner"):
            provider = provider.inner
            found.append(type(provider))
        return found

    assert layers(from_config) == layers(by_hand)
    assert from_config.inner.inner.inner.attempts == by_hand.inner.inner.inner.attempts == 2


# -- registries, with test distributions declaring entry points -------------------------------


def fake_distribution(root: Path, name: str, entry_points: dict[str, dict[str, str]]) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for group, eps in entry_points.items()
        )
    )


@pytest.fixture
def fresh_registries() -> Any:
    provider_registry.refresh()
    middleware_registry.refresh()
    yield
    provider_registry.refresh()
    middleware_registry.refresh()


def test_entry_points_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registries: None) -> None:
    """Providers from our group and from NeMo Gym's group, and middleware from ours, are found by name."""
    fake_distribution(tmp_path, "acme_sandboxes", {
        "sandbox_middleware.providers": {"acme": "tests.providers:PlainProvider"},
        "nemo_gym.sandbox_providers": {"gymish": "tests.providers:EndpointProvider"},
        "sandbox_middleware.middleware": {"noop": "sandbox_middleware:ProviderMiddleware"},
    })  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    provider_registry.refresh()
    middleware_registry.refresh()
    assert provider_registry.get("acme") is PlainProvider
    assert "acme_sandboxes" in provider_registry.origin("gymish") and "nemo_gym" in provider_registry.origin("gymish")
    built: Any = build_provider({"provider": "acme", "middleware": ["noop", "metrics"]})
    assert built.name == "plain" and type(built.inner).__name__ == "MetricsMiddleware"


def test_duplicate_names_name_both_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registries: None
) -> None:
    """Two distributions publishing one name is an error naming both; so is shadowing a built-in."""
    fake_distribution(
        tmp_path, "first_dist", {"sandbox_middleware.providers": {"dup": "tests.providers:PlainProvider"}}
    )
    fake_distribution(tmp_path, "second_dist", {"nemo_gym.sandbox_providers": {"dup": "tests.providers:PtyProvider"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    provider_registry.refresh()
    with pytest.raises(RegistryError, match="duplicate provider name 'dup'") as info:
        provider_registry.get("dup")
    assert "first_dist" in str(info.value) and "second_dist" in str(info.value)

    shadow = tmp_path / "shadow"
    fake_distribution(
        shadow, "shadow_dist", {"sandbox_middleware.providers": {"local": "tests.providers:PlainProvider"}}
    )
    registry = Registry("provider", ["sandbox_middleware.providers"], {"local": lambda: LocalProvider})
    monkeypatch.setattr("sys.path", [str(shadow), *__import__("sys").path])
    with pytest.raises(RegistryError, match=r"built-in .* and distribution 'shadow_dist'"):
        registry.names()


def test_register_provider_takes_precedence(fresh_registries: None) -> None:
    """A name registered in code wins over the built-in; registering twice needs replace=True."""
    registry = Registry("provider", [], {"local": lambda: LocalProvider})
    registry.register("local", PlainProvider)
    assert registry.get("local") is PlainProvider
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("local", FaultInjectingProvider)
    registry.register("local", FaultInjectingProvider, replace=True)
    assert registry.get("local") is FaultInjectingProvider


def test_admission_and_warm_pool_from_config(tmp_path: Path) -> None:
    """Both layers by name with every option; out-of-range and unknown values listed in one ConfigError."""
    from sandbox_middleware import AdmissionMiddleware, WarmPoolMiddleware

    config = {
        "provider": {"local": {"isolation": "none", "base_dir": str(tmp_path / "boxes")}},
        "middleware": [
            {"warm_pool": {"size": 4, "max_age_s": 600, "refill_concurrency": 2, "max_keys": 3}},
            {"admission": {"max_concurrent_creates": 20, "max_held": 100, "max_create_rate": 5.5, "burst": 2,
                           "start_jitter_s": 0.5, "shared": "host", "shared_key": "e2b-account",
                           "shared_path": str(tmp_path / "limits.sqlite"), "max_retry_after_s": 60}},
        ],
    }  # fmt: skip
    provider: Any = build_provider(config)
    assert isinstance(provider, WarmPoolMiddleware) and isinstance(provider.inner, AdmissionMiddleware)
    pool, admission = provider, provider.inner
    assert (pool.size, pool.max_age_s, pool.refill_concurrency, pool.max_keys) == (4, 600, 2, 3)
    assert (admission.max_concurrent_creates, admission.max_held, admission.max_create_rate) == (20, 100, 5.5)
    assert (admission.shared, admission.shared_key, admission.shared_path) == (
        "host",
        "e2b-account",
        tmp_path / "limits.sqlite",
    )
    anyio.run(provider.aclose)
    broken = {
        "provider": "local",
        "middleware": [{"warm_pool": {"size": 0}}, {"admission": {"max_create_rate": -1, "shared": "cluster"}}],
    }
    with pytest.raises(ConfigError) as caught:
        resolve_config(broken)
    assert caught.value.problems == [
        "middleware[0] (warm_pool): option 'size' must be >= 1 and <= 1024, not 0",
        "middleware[1] (admission): option 'max_create_rate' must be > 0, not -1",
        "middleware[1] (admission): option 'shared' must be one of 'process', 'host', 'ray', not 'cluster' (str)",
    ]
