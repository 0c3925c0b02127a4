"""Create failures across the two libraries: either library's ``except SandboxCreateError`` catches both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.sandbox.providers import SandboxCreateError as NemoCreateError  # noqa: E402
from nemo_gym.sandbox.providers.base import (  # noqa: E402
    SandboxCreateVerificationError as NemoCreateVerificationError,
)
from nemo_gym.sandbox.providers.local import LocalProvider as NemoLocalProvider  # noqa: E402

import sandbox_middleware  # noqa: E402
from sandbox_middleware import SandboxSpec, stack  # noqa: E402
from sandbox_middleware._errors import as_create_error  # noqa: E402

pytestmark = pytest.mark.anyio


class FailingCreate(NemoLocalProvider):
    """NeMo Gym's local provider whose create fails with NeMo Gym's own error class."""

    error: type[Exception] = NemoCreateError

    async def create(self, spec: Any) -> Any:
        raise self.error("control plane busy (scripted)")


@pytest.mark.parametrize(
    ("nemo", "ours"),
    [
        (NemoCreateError, sandbox_middleware.SandboxCreateError),
        (NemoCreateVerificationError, sandbox_middleware.SandboxCreateVerificationError),
    ],
)
async def test_a_nemo_create_failure_becomes_an_instance_of_both(
    tmp_path: Path, nemo: type[Exception], ours: type[Exception]
) -> None:
    """NeMo Gym's real provider raises its own class; translated, it is ours and NeMo Gym's, of the same
    kind, with the message and the original as its cause; ours and anything else pass unchanged."""
    provider = FailingCreate(workspace_root=str(tmp_path / "boxes"))
    provider.error = nemo
    with pytest.raises(nemo) as raised:
        await provider.create(SandboxSpec())
    translated = as_create_error(raised.value)
    assert isinstance(translated, ours) and isinstance(translated, nemo)
    assert translated.__cause__ is raised.value
    assert "control plane busy (scripted)" in str(translated)
    for catch in (sandbox_middleware.SandboxCreateError, NemoCreateError):
        try:
            raise translated
        except catch:
            pass
    already = sandbox_middleware.SandboxCreateError("ours")
    assert as_create_error(already) is already
    other = ValueError("not a create failure")
    assert as_create_error(other) is other


@pytest.mark.xfail(
    strict=True,
    reason="needs the catch in ProviderMiddleware.create (_core.py, not this branch's file): "
    "`except NemoCreateError as exc: raise as_create_error(exc) from exc`",
)
async def test_a_nemo_create_failure_out_of_our_stack_is_caught_by_our_class(tmp_path: Path) -> None:
    provider = stack(FailingCreate(workspace_root=str(tmp_path / "boxes")), [])
    with pytest.raises(sandbox_middleware.SandboxCreateError):
        await stack(provider, [sandbox_middleware.Middleware(sandbox_middleware.ProviderMiddleware)]).create(
            SandboxSpec()
        )
