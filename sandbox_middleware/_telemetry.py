"""The sandbox middlewares' telemetry names; the machinery shared with ``tokens`` is ``_shared_telemetry``."""

from __future__ import annotations

from typing import Any

from _shared_telemetry import *  # noqa: F403 (re-exported for the middlewares)
from _shared_telemetry import Instrument

PROVIDER_ATTR = "nemo.gym.sandbox.provider"
SANDBOX_ID_ATTR = "nemo.gym.sandbox.id"
SNAPSHOT_ID_ATTR = "nemo.gym.sandbox.snapshot_id"
OPERATION_ATTR = "operation"

# Sandbox durations: NeMo Gym's own boundaries (``gym_metrics.SANDBOX_DURATION_BOUNDARIES_MS``), so
# one dashboard reads both; a remote start takes about a minute, the SDK's default buckets end at 10 s.
SANDBOX_DURATION_BOUNDARIES_MS: tuple[float, ...] = (
    250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000,
)  # fmt: skip

# Snapshot sizes: 1 MiB to 64 GiB by fours (a repository with its dependencies is some hundreds of MB).
SNAPSHOT_SIZE_BOUNDARIES_BYTES: tuple[float, ...] = tuple(float(4**power) for power in range(10, 19))


def size_bytes(name: str, description: str, buckets: tuple[float, ...]) -> Any:
    """A histogram of sizes in bytes (unit ``By``)."""
    return Instrument("histogram", name, "By", description, buckets)
