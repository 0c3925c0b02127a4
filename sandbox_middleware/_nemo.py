"""NeMo Gym 0.7.0's sandbox protocol module, when it is installed and imports: our value types and
error classes derive from its classes of the same name (``_protocol.py``, ``_errors.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

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
