"""Interop with NeMo Gym 0.7.0's own released code (its venv: ``bash scripts/install-nemo-gym.sh``)."""

from __future__ import annotations

import importlib.util

from tests.needs import unavailable


def require_nemo_gym() -> None:
    """Skip the calling test module without NeMo Gym; with REQUIRE_NEMO_GYM=1 (CI) fail it instead."""
    if importlib.util.find_spec("nemo_gym") is not None:
        return
    message = (
        "NeMo Gym is not installed for the interop tests; run them in its venv: "
        '"$(bash scripts/install-nemo-gym.sh | tail -n 1)" -m pytest tests/interop'
    )
    unavailable(message, "REQUIRE_NEMO_GYM", module=True)
