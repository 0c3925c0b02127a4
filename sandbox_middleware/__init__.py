"""Composable middleware for sandbox providers (the NeMo Gym ``SandboxProvider`` protocol)."""

from . import _protocol, middleware
from ._config import ResolvedStack, build_provider, load_config, resolve_config
from ._core import Middleware, Operation, ProviderMiddleware, stack
from ._errors import (
    BwrapUnavailableError,
    ConfigError,
    DockerRuntimeNotFoundError,
    DockerUnavailableError,
    RegistryError,
    SandboxAdmissionError,
    SandboxArgumentError,
    SandboxExpiredError,
    SandboxImageNotFoundError,
    SandboxLimitError,
    SandboxNotStartedError,
    SandboxQuotaExceededError,
    SandboxRateLimitedError,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
    SandboxTransferLimitError,
)
from ._protocol import *  # noqa: F403 - its __all__, errors it re-exports among them
from ._reaper import ReapedSandbox, ReapReport, UnreapedSandbox, reap
from ._registry import register_middleware, register_provider
from ._sandbox import Sandbox
from .middleware import *  # noqa: F403 - the layers, by their __all__
from .providers import DockerProvider, LocalProvider

__all__ = [
    "BwrapUnavailableError",
    "ConfigError",
    "DockerProvider",
    "DockerRuntimeNotFoundError",
    "DockerUnavailableError",
    "LocalProvider",
    "Middleware",
    "Operation",
    "ProviderMiddleware",
    "ReapReport",
    "ReapedSandbox",
    "RegistryError",
    "ResolvedStack",
    "Sandbox",
    "SandboxAdmissionError",
    "SandboxArgumentError",
    "SandboxExpiredError",
    "SandboxImageNotFoundError",
    "SandboxLimitError",
    "SandboxNotStartedError",
    "SandboxQuotaExceededError",
    "SandboxRateLimitedError",
    "SandboxSnapshotError",
    "SandboxSnapshotNotFoundError",
    "SandboxTransferLimitError",
    "UnreapedSandbox",
    "build_provider",
    "load_config",
    "reap",
    "register_middleware",
    "register_provider",
    "resolve_config",
    "stack",
]
__all__ += middleware.__all__  # the layers
__all__ += _protocol.__all__  # the protocol's value types, capabilities and the errors it names
