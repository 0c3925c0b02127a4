"""Composable middleware for sandbox providers (the NeMo Gym ``SandboxProvider`` protocol)."""

from ._core import Middleware, ProviderMiddleware, stack
from ._local import BwrapUnavailableError, LocalProvider
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
from ._sandbox import Sandbox, SandboxNotStartedError

__all__ = [
    "BwrapUnavailableError",
    "ConnectableProvider",
    "LocalProvider",
    "Middleware",
    "ProviderMiddleware",
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
    "stack",
]
