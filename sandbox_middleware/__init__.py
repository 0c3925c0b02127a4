"""Composable middleware for sandbox providers (the NeMo Gym ``SandboxProvider`` protocol)."""

from ._budget import RetryBudget
from ._config import ConfigError, ResolvedStack, build_provider, load_config, resolve_config
from ._core import Middleware, ProviderMiddleware, stack
from ._listing import SandboxListing, SupportsSandboxList
from ._local import (
    BwrapUnavailableError,
    LocalProvider,
    SandboxArgumentError,
    SandboxExpiredError,
    SandboxLimitError,
    SandboxTransferLimitError,
)
from ._metrics import MetricsMiddleware
from ._ownership import OwnershipMiddleware
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
from ._reaper import ReapedSandbox, reap
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
    "OwnershipMiddleware",
    "ProviderMiddleware",
    "ReapedSandbox",
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
    "SandboxListing",
    "SandboxNotFoundError",
    "SandboxNotStartedError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxTransferLimitError",
    "SupportsSandboxEndpoint",
    "SupportsSandboxList",
    "SupportsSandboxPty",
    "TracingMiddleware",
    "build_provider",
    "load_config",
    "reap",
    "register_middleware",
    "register_provider",
    "resolve_config",
    "stack",
]
