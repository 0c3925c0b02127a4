"""The sandbox middlewares' telemetry names; the machinery shared with ``tokens`` is ``_shared_telemetry``."""

from __future__ import annotations

from _shared_telemetry import *  # noqa: F403 (re-exported for the middlewares)

PROVIDER_ATTR = "nemo.gym.sandbox.provider"
SANDBOX_ID_ATTR = "nemo.gym.sandbox.id"
OPERATION_ATTR = "operation"
