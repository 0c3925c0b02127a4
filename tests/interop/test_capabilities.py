"""NeMo Gym's ten capability protocols: ours are structurally identical, and a five-layer stack has
each exactly when its innermost provider has it, as NeMo Gym's own ``isinstance`` sees it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.sandbox.providers import base as nemo_base  # noqa: E402
from nemo_gym.sandbox.providers.local import LocalProvider as NemoLocalProvider  # noqa: E402

import sandbox_middleware  # noqa: E402
from sandbox_middleware import (  # noqa: E402
    CAPABILITIES,
    LocalProvider,
    Middleware,
    ProviderMiddleware,
    recommended_middleware,
    stack,
)

from ..providers import PlainProvider, scripted_provider  # noqa: E402

NEMO_CAPABILITIES = [
    cls
    for name, cls in vars(nemo_base).items()
    if inspect.isclass(cls) and getattr(cls, "_is_runtime_protocol", False) and name != "SandboxPtySession"
]
FIVE_LAYERS = [*recommended_middleware(), Middleware(ProviderMiddleware)]


def _members(protocol: type) -> dict[str, list[tuple[str, Any, Any]]]:
    """Each method's parameters as (name, kind, default): annotations are compared by the methods' use."""
    return {
        name: [(p.name, p.kind, p.default) for p in inspect.signature(value).parameters.values()]
        for name, value in vars(protocol).items()
        if callable(value) and not name.startswith("_")
    }


def test_ten_protocols_all_in_our_table() -> None:
    """NeMo Gym 0.7.0 has ten capability protocols; each is in CAPABILITIES under its name (beside our
    own listing and snapshot capabilities, which NeMo Gym does not have)."""
    assert len(NEMO_CAPABILITIES) == 10
    own = (sandbox_middleware.SupportsSandboxList, sandbox_middleware.SupportsSandboxSnapshot)
    ours = sorted(p.__name__ for p in CAPABILITIES if p not in own)
    assert sorted(p.__name__ for p in NEMO_CAPABILITIES) == ours


@pytest.mark.parametrize("theirs", NEMO_CAPABILITIES, ids=lambda p: p.__name__)
def test_protocol_is_structurally_identical(theirs: type) -> None:
    """Same methods, sync or async alike, with the same parameters, kinds and defaults."""
    ours = getattr(sandbox_middleware, theirs.__name__)
    assert _members(ours) == _members(theirs)
    for name in _members(theirs):
        assert inspect.iscoroutinefunction(vars(ours)[name]) == inspect.iscoroutinefunction(vars(theirs)[name])
    pty_session = sandbox_middleware.SandboxPtySession
    assert _members(pty_session) == _members(nemo_base.SandboxPtySession)


@pytest.mark.parametrize("theirs", NEMO_CAPABILITIES, ids=lambda p: p.__name__)
def test_capability_present_and_absent_as_nemo_gym_sees_it(theirs: type) -> None:
    """For a provider with the capability and ones without it, ``isinstance`` against NeMo Gym's own
    protocol class is the same for the bare provider and a five-layer stack of it."""
    ours = getattr(sandbox_middleware, theirs.__name__)
    others = [p for p in CAPABILITIES if p is not ours]
    with_it = scripted_provider(ours)
    local = LocalProvider(isolation="none")  # a capability is the class's: no need to start bwrap
    without_it: list[Any] = [PlainProvider(), scripted_provider(*others), NemoLocalProvider(), local]
    assert isinstance(with_it, theirs)
    assert isinstance(stack(with_it, FIVE_LAYERS), theirs)
    for bare in without_it:
        assert isinstance(bare, theirs) == isinstance(stack(bare, FIVE_LAYERS), theirs)
    assert not isinstance(stack(scripted_provider(*others), FIVE_LAYERS), theirs)
