"""Composable middleware for sandbox providers (the NeMo Gym ``SandboxProvider`` protocol)."""

from ._budget import RetryBudget
from ._config import ConfigError, ResolvedStack, build_provider, load_config, resolve_config
from ._core import Middleware, ProviderMiddleware, stack
from ._local import (
    BwrapUnavailableError,
    LocalProvider,
    SandboxArgumentError,
    SandboxExpiredError,
    SandboxLimitError,
    SandboxTransferLimitError,
)
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
from ._registry import RegistryError, register_middleware, register_provider
from ._release_accounting import HeldSandbox, ReleaseAccountingMiddleware
from ._retry import RetryMiddleware
from ._sandbox import Sandbox, SandboxNotStartedError
from ._tracing import TracingMiddleware

__all__ = [
    "BwrapUnavailableError",
    "ConfigError",
    "ConnectableProvider",
    "HeldSandbox",
    "LocalProvider",
    "MetricsMiddleware",
    "Middleware",
    "ProviderMiddleware",
    "RegistryError",
    "ReleaseAccountingMiddleware",
    "ResolvedStack",
    "RetryBudget",
    "RetryMiddleware",
    "Sandbox",
    "SandboxArgumentError",
    "SandboxCreateError",
    "SandboxEndpoint",
    "SandboxError",
    "SandboxExecResult",
    "SandboxExpiredError",
    "SandboxHandle",
    "SandboxLimitError",
    "SandboxNotFoundError",
    "SandboxNotStartedError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxTransferLimitError",
    "SupportsSandboxEndpoint",
    "SupportsSandboxPty",
    "TracingMiddleware",
    "build_provider",
    "load_config",
    "register_middleware",
    "register_provider",
    "resolve_config",
    "stack",
]
