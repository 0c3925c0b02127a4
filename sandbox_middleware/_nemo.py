"""NeMo Gym 0.7.0's sandbox protocol module, when it is installed and imports: our value types and
error classes derive from its classes of the same name (``_protocol.py``, ``_errors.py``), the bases
below; without NeMo Gym each base is ``object`` and our classes stand alone."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

logger = logging.getLogger("sandbox_middleware")


def _nemo_gym_base() -> ModuleType | None:
    """NeMo Gym's ``nemo_gym.sandbox.providers.base`` when it is installed and imports, else None."""
    if importlib.util.find_spec("nemo_gym") is None:
        return None
    try:
        return importlib.import_module("nemo_gym.sandbox.providers.base")
    except Exception as exc:  # installed but broken here: this package stands alone
        logger.warning("NeMo Gym is installed but its sandbox protocol does not import (%r); not interoperating", exc)
        return None


NEMO_GYM: ModuleType | None = _nemo_gym_base()
"""NeMo Gym's protocol module whose classes ours derive from, or None."""


def nemo_class(name: str) -> type:
    """NeMo Gym's class ``name``, or ``object`` without NeMo Gym (a base that adds nothing)."""
    cls: type = getattr(NEMO_GYM, name) if NEMO_GYM is not None else object
    return cls


if TYPE_CHECKING:  # the type checker sees the stand-alone classes; structurally they are NeMo Gym's
    NemoResources: TypeAlias = object
    NemoSpec: TypeAlias = object
    NemoHandle: TypeAlias = object
    NemoExecResult: TypeAlias = object
    NemoEndpoint: TypeAlias = object
    NemoPtySpec: TypeAlias = object
    NemoCreateError: TypeAlias = object
    NemoCreateVerificationError: TypeAlias = object
    NemoPtyError: TypeAlias = object
else:
    NemoResources, NemoSpec, NemoHandle = map(nemo_class, ("SandboxResources", "SandboxSpec", "SandboxHandle"))
    NemoExecResult, NemoEndpoint, NemoPtySpec = map(
        nemo_class, ("SandboxExecResult", "SandboxEndpoint", "SandboxPtySpec")
    )
    NemoCreateError, NemoCreateVerificationError, NemoPtyError = map(
        nemo_class, ("SandboxCreateError", "SandboxCreateVerificationError", "SandboxPtyError")
    )
