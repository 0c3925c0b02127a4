"""Test helpers for users of this package: a fault-injecting provider that keeps the ground truth.

Fixtures for an in-memory OpenTelemetry SDK live in ``sandbox_middleware.testing.fixtures``
(``pytest_plugins = ["sandbox_middleware.testing.fixtures"]``; needs ``opentelemetry-sdk``).
"""

from .._errors import InjectedCreateError, InjectedFault
from ._faults import (
    FAULT_STREAM,
    LOST_CREATE,
    OPERATIONS,
    SNAPSHOT_OPERATIONS,
    FaultInjectingProvider,
    parse_faults,
)

__all__ = [
    "FAULT_STREAM",
    "LOST_CREATE",
    "OPERATIONS",
    "SNAPSHOT_OPERATIONS",
    "FaultInjectingProvider",
    "InjectedCreateError",
    "InjectedFault",
    "parse_faults",
]
