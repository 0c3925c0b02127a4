"""The provider protocol: value types, errors and capabilities.

Names, fields and signatures mirror NeMo Gym's sandbox protocol of the same names, so a NeMo Gym
provider can be wrapped as it is and a wrapped provider can be handed back to NeMo Gym.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ConnectableProvider",
    "SandboxCreateError",
    "SandboxEndpoint",
    "SandboxError",
    "SandboxExecResult",
    "SandboxHandle",
    "SandboxNotFoundError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxStatus",
    "SupportsSandboxEndpoint",
    "SupportsSandboxPty",
]


class SandboxStatus(str, enum.Enum):  # noqa: UP042 - NeMo Gym compares these with plain strings
    """Provider-neutral lifecycle status of one sandbox."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    ERROR = "error"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SandboxSpec:
    """What to create.

    ``files`` maps a path inside the sandbox to a local file that ``Sandbox`` uploads there right
    after creation. Providers ignore the fields they cannot honour only where their docs say so.
    """

    image: str | None = None
    ttl_s: float | None = None
    ready_timeout_s: float | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    resources: Any = None
    entrypoint: list[str] | None = None
    provider_options: Mapping[str, Any] = field(default_factory=dict)
    ports: tuple[int, ...] = ()


@dataclass
class SandboxHandle:
    """A created sandbox; ``raw`` is the provider's own opaque state."""

    sandbox_id: str
    provider_name: str
    raw: Any = None


@dataclass(frozen=True)
class SandboxExecResult:
    """One command's outcome; ``error_type`` is set when the runtime (not the command) failed."""

    stdout: str | None
    stderr: str | None
    return_code: int
    error_type: str | None = None


@dataclass(frozen=True)
class SandboxEndpoint:
    """A caller-reachable URL for a port served inside a sandbox, with any headers it needs."""

    endpoint: str
    headers: Mapping[str, str] = field(default_factory=dict)


class SandboxError(RuntimeError):
    """Base class of every error this package raises about a sandbox."""


class SandboxCreateError(SandboxError):
    """The provider could not create a sandbox."""


class SandboxNotFoundError(SandboxError):
    """The handle names no live sandbox of this provider (never created here, or already closed)."""


class SandboxPathError(SandboxError):
    """A file path would leave the sandbox (``..`` or a symlink pointing outside)."""


class SandboxProvider(Protocol):
    """What a sandbox backend implements (NeMo Gym's ``SandboxProvider``)."""

    name: str

    async def create(self, spec: SandboxSpec) -> SandboxHandle: ...

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult: ...

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None: ...

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None: ...

    async def status(self, handle: SandboxHandle) -> SandboxStatus: ...

    async def close(self, handle: SandboxHandle) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SupportsSandboxEndpoint(Protocol):
    """Optional capability: resolve a declared port to a reachable endpoint."""

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint: ...


@runtime_checkable
class ConnectableProvider(Protocol):
    """Optional capability: rebuild a handle in another process from a JSON descriptor."""

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]: ...

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle: ...


@runtime_checkable
class SupportsSandboxPty(Protocol):
    """Optional capability: an interactive terminal; spec and session are the provider's own types."""

    async def create_pty(self, handle: SandboxHandle, spec: Any) -> Any: ...


# Errors carry their public module, so `error.type` on dashboards reads e.g. sandbox_middleware.SandboxCreateError.
SandboxError.__module__ = "sandbox_middleware"
SandboxCreateError.__module__ = "sandbox_middleware"
SandboxNotFoundError.__module__ = "sandbox_middleware"
SandboxPathError.__module__ = "sandbox_middleware"
