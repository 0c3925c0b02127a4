"""Composable middleware for sandbox providers (the NeMo Gym ``SandboxProvider`` protocol)."""

from ._budget import RetryBudget
from ._core import Middleware, ProviderMiddleware, stack
from ._local import BwrapUnavailableError, LocalProvider
from ._metrics import MetricsMiddleware
from ._protocol import (
    ConnectableProvider,
    SandboxCreateError,
    SandboxEndpoint,
    SandboxError,
    SandboxExecResult,
    SandboxHandle,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxProvider,
    SandboxSpec,
    SandboxStatus,
    SupportsSandboxEndpoint,
    SupportsSandboxPty,
)
from ._release_accounting import HeldSandbox, ReleaseAccountingMiddleware
from ._retry import RetryMiddleware
from ._sandbox import Sandbox, SandboxNotStartedError
from ._tracing import TracingMiddleware

__all__ = [
    "BwrapUnavailableError",
    "ConnectableProvider",
    "HeldSandbox",
    "LocalProvider",
    "MetricsMiddleware",
    "Middleware",
    "ProviderMiddleware",
    "ReleaseAccountingMiddleware",
    "RetryBudget",
    "RetryMiddleware",
    "Sandbox",
    "SandboxCreateError",
    "SandboxEndpoint",
    "SandboxError",
    "SandboxExecResult",
    "SandboxHandle",
    "SandboxNotFoundError",
    "SandboxNotStartedError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxStatus",
    "SupportsSandboxEndpoint",
    "SupportsSandboxPty",
    "TracingMiddleware",
    "stack",
]
