"""The provider protocol: value types and capabilities, NeMo Gym 0.7.0's in both directions (errors: ``_errors.py``).

Names, fields, signatures and validation are NeMo Gym's. When NeMo Gym is installed (and imports),
every value type and error class here also *derives from* NeMo Gym's class of the same name, so
NeMo Gym's own ``isinstance`` checks and ``except`` clauses accept what this package makes (its
facade's endpoint check, ``except SandboxCreateError`` around its ``AsyncSandbox.start``). Without
NeMo Gym the classes stand alone. Python's ``except`` matches by inheritance only, so the reverse
direction is ``SANDBOX_CREATE_ERRORS``: both libraries' create-failure classes in one tuple.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

from ._errors import (
    SANDBOX_CREATE_ERRORS,
    SandboxCreateError,
    SandboxCreateVerificationError,
    SandboxError,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxPtyError,
    SandboxSnapshotError,
    SandboxValueError,
)
from ._nemo import (
    NEMO_GYM,
    NemoEndpoint,
    NemoExecResult,
    NemoHandle,
    NemoPtySpec,
    NemoResources,
    NemoSpec,
)

__all__ = [
    "CAPABILITIES",
    "SANDBOX_CREATE_ERRORS",
    "ConnectableProvider",
    "ExecResult",
    "SandboxCreateError",
    "SandboxCreateVerificationError",
    "SandboxEndpoint",
    "SandboxError",
    "SandboxExecResult",
    "SandboxHandle",
    "SandboxListing",
    "SandboxNotFoundError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxPtyError",
    "SandboxPtySession",
    "SandboxPtySpec",
    "SandboxResources",
    "SandboxSnapshot",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxValueError",
    "SupportsSandboxBackgroundServices",
    "SupportsSandboxEndpoint",
    "SupportsSandboxList",
    "SupportsSandboxNetwork",
    "SupportsSandboxPauseResume",
    "SupportsSandboxPortForwarding",
    "SupportsSandboxPty",
    "SupportsSandboxPtyAttach",
    "SupportsSandboxRuntimeRequirements",
    "SupportsSandboxSharedStorage",
    "SupportsSandboxSnapshot",
]


class SandboxStatus(str, enum.Enum):  # noqa: UP042 - NeMo Gym compares these with plain strings
    """Provider-neutral lifecycle status of one sandbox (equal to NeMo Gym's member of the same value)."""

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    ERROR = "error"
    UNKNOWN = "unknown"


_RESOURCE_FIELDS: dict[str, type] = {"cpu": float, "memory_mib": int, "disk_gib": int, "gpu": int, "gpu_type": str}


@dataclass(frozen=True)
class SandboxResources(NemoResources):
    """A provider-neutral resource request; ``None`` fields ask for nothing."""

    cpu: float | None = None
    memory_mib: int | None = None
    disk_gib: int | None = None
    gpu: int | None = None
    gpu_type: str | None = None

    @classmethod
    def from_mapping(cls, resources: Mapping[str, Any] | None) -> SandboxResources:
        """Resources from a mapping of the field names; unknown keys and unconvertible values are errors."""
        if resources is None:
            return cls()
        if not isinstance(resources, Mapping):
            raise SandboxValueError(
                f"sandbox resources must be a SandboxResources or a mapping, not {type(resources).__name__}"
            )
        unknown = set(resources) - set(_RESOURCE_FIELDS)
        if unknown:
            raise SandboxValueError(
                f"Unknown sandbox resource keys: {', '.join(sorted(map(str, unknown)))}. "
                f"Expected keys: {', '.join(sorted(_RESOURCE_FIELDS))}"
            )
        values: dict[str, Any] = {}
        for key, convert in _RESOURCE_FIELDS.items():
            value = resources.get(key)
            try:
                values[key] = None if value is None else convert(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise SandboxValueError(
                    f"sandbox resource {key!r} must be a {convert.__name__}, got {value!r}"
                ) from exc
        return cls(**values)


# A NeMo Gym ``SandboxResources`` is kept as it is: same fields, and our own derives from it.
_RESOURCES_CLASS: type = NemoResources if NEMO_GYM is not None else SandboxResources


@dataclass(frozen=True)
class SandboxSpec(NemoSpec):
    """What to create.

    ``files`` maps a path inside the sandbox to the file's *contents* (text), written there right
    after creation by either library's facade; local files go through ``Sandbox(local_files=...)``.
    ``resources`` is always a ``SandboxResources`` (a mapping is converted, unknown keys refused)
    and ``ports`` a tuple of distinct TCP ports, validated as NeMo Gym validates them.
    Providers ignore the fields they cannot honour only where their docs say so.
    """

    image: str | None = None
    ttl_s: int | float | None = None
    ready_timeout_s: int | float | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    resources: SandboxResources | Mapping[str, Any] = field(default_factory=SandboxResources)
    entrypoint: list[str] | None = None
    provider_options: Mapping[str, Any] = field(default_factory=dict)
    ports: tuple[int, ...] | list[int] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.resources, _RESOURCES_CLASS):
            object.__setattr__(
                self, "resources", SandboxResources.from_mapping(cast("Mapping[str, Any]", self.resources))
            )
        object.__setattr__(self, "ports", _ports(self.ports))
        for target, contents in self.files.items():
            if not isinstance(contents, str):
                hint = (
                    "; to upload a local file use Sandbox(provider, spec, local_files={target: local_path})"
                    if isinstance(contents, PurePath)
                    else ""
                )
                raise SandboxValueError(
                    f"SandboxSpec.files maps a sandbox path to the file's text contents; "
                    f"{target!r} maps to a {type(contents).__name__}{hint}"
                )


def _ports(ports: Any) -> tuple[int, ...]:
    if not isinstance(ports, (list, tuple)):
        raise SandboxValueError(f"Sandbox ports must be a list or tuple of TCP port numbers, not {ports!r}")
    normalized: list[int] = []
    for raw in ports:
        try:
            if isinstance(raw, bool) or not isinstance(raw, (int, str)):
                raise TypeError(raw)
            port = int(raw)
        except (TypeError, ValueError) as exc:
            raise SandboxValueError(f"Invalid sandbox TCP port: {raw!r}") from exc
        if not 1 <= port <= 65535:
            raise SandboxValueError(f"Sandbox TCP port must be between 1 and 65535, got {port}")
        if port in normalized:
            raise SandboxValueError(f"Duplicate sandbox TCP port: {port}")
        normalized.append(port)
    return tuple(normalized)


@dataclass
class SandboxHandle(NemoHandle):
    """A created sandbox; ``raw`` is the provider's own opaque state."""

    sandbox_id: str
    provider_name: str
    raw: Any = None


@dataclass(frozen=True)
class SandboxExecResult(NemoExecResult):
    """One command's outcome; ``error_type`` is set when the runtime (not the command) failed."""

    stdout: str | None
    stderr: str | None
    return_code: int
    error_type: str | None = None


ExecResult = SandboxExecResult


@dataclass(frozen=True)
class SandboxEndpoint(NemoEndpoint):
    """A caller-reachable absolute URL for a port served inside a sandbox, with any headers it needs."""

    endpoint: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        url = self.endpoint.strip() if isinstance(self.endpoint, str) else ""
        parts = urlsplit(url)
        if not parts.scheme or not parts.netloc:
            raise SandboxValueError(f"Sandbox endpoint must be a non-empty absolute URL, got {self.endpoint!r}")
        if not isinstance(self.headers, Mapping):
            raise SandboxValueError(f"Sandbox endpoint headers must be a mapping, not {type(self.headers).__name__}")
        object.__setattr__(self, "endpoint", url)
        object.__setattr__(self, "headers", {str(key): str(value) for key, value in self.headers.items()})


@dataclass(frozen=True)
class SandboxPtySpec(NemoPtySpec):
    """An interactive terminal request; ``command=None`` spawns the shell, ``pty=False`` selects pipe mode."""

    command: str | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    rows: int = 24
    cols: int = 80
    user: str | int | None = None
    pty: bool = True


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
class SandboxPtySession(Protocol):
    """One live interactive terminal; an async context manager whose exit closes it."""

    session_id: str
    mode: str | None

    @property
    def closed(self) -> bool: ...

    async def read(self, *, timeout_s: float | None = None) -> bytes: ...

    async def read_stderr(self, *, timeout_s: float | None = None) -> bytes: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def write(self, data: bytes) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def send_signal(self, signal: str) -> None: ...

    async def wait_exit(self, *, timeout_s: float | None = None) -> int: ...

    async def run_detached(self, command: str, *, poll_interval_s: float = 15.0) -> tuple[bytes, int | None]: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> SandboxPtySession: ...

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None: ...


# The ten optional capabilities of NeMo Gym 0.7.0, member for member (then this package's own: list, snapshot).


@runtime_checkable
class SupportsSandboxEndpoint(Protocol):
    """Resolve a declared service port to a caller-reachable endpoint."""

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint: ...


@runtime_checkable
class ConnectableProvider(Protocol):
    """Rebuild a handle in another process from a JSON descriptor."""

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]: ...

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle: ...


@runtime_checkable
class SupportsSandboxPty(Protocol):
    """Interactive PTY sessions."""

    async def create_pty(self, handle: SandboxHandle, spec: SandboxPtySpec) -> SandboxPtySession: ...


@runtime_checkable
class SupportsSandboxPtyAttach(Protocol):
    """Re-attach to a PTY session by id (sessions that live in the sandbox, not the client)."""

    async def attach_pty(
        self, handle: SandboxHandle, session_id: str, *, takeover: bool = True, since: int | None = None
    ) -> SandboxPtySession: ...


@runtime_checkable
class SupportsSandboxPauseResume(Protocol):
    """Pause a sandbox preserving its state, and resume it."""

    async def pause(self, handle: SandboxHandle) -> None: ...

    async def resume(self, handle: SandboxHandle) -> None: ...


@runtime_checkable
class SupportsSandboxNetwork(Protocol):
    """Direct networking between sandboxes, preserving service ports."""

    def validate_networking(self) -> None: ...

    async def network_address(self, handle: SandboxHandle) -> str: ...

    async def set_hosts(self, handle: SandboxHandle, hosts: Mapping[str, str]) -> None: ...


@runtime_checkable
class SupportsSandboxPortForwarding(Protocol):
    """Loopback TCP forwarding, running until cancellation."""

    def validate_port_forwarding(self) -> None: ...

    async def forward_ports(
        self, handle: SandboxHandle, target_address: str, ports: tuple[int, ...], *, ready_file: str
    ) -> None: ...


@runtime_checkable
class SupportsSandboxSharedStorage(Protocol):
    """A shared filesystem provisioned by the operator's provider config."""

    def shared_volume_options(self, source: str | None, target: str, *, read_only: bool = False) -> dict[str, Any]: ...

    def shared_volume_metadata(self) -> dict[str, str]: ...


@runtime_checkable
class SupportsSandboxRuntimeRequirements(Protocol):
    """Validation and setup of task-declared runtime requirements."""

    def validate_runtime_requirements(
        self, *, cap_add: tuple[str, ...], shm_size: int | None
    ) -> dict[str, str] | None: ...

    async def configure_runtime(
        self, handle: SandboxHandle, *, cap_add: tuple[str, ...], shm_size: int | None
    ) -> None: ...


@runtime_checkable
class SupportsSandboxBackgroundServices(Protocol):
    """An execution path that keeps services started by one command alive for later ones."""

    async def exec_with_background_services(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        timeout_s: int | float | None = None,
    ) -> SandboxExecResult: ...


@dataclass(frozen=True)
class SandboxListing:
    """One sandbox a provider knows of: a handle usable with ``close``, its metadata, its creation time."""

    handle: SandboxHandle
    metadata: Mapping[str, str] = field(default_factory=dict)
    created_at: float | None = None  # seconds since the epoch, where the provider knows it


@runtime_checkable
class SupportsSandboxList(Protocol):
    """List the provider's sandboxes whose metadata contains every item of ``metadata``, including
    those no process holds a handle to (a lost create response, a killed worker)."""

    async def list(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxListing]: ...


_SNAPSHOT_FIELDS = ("snapshot_id", "provider", "created", "size_bytes", "metadata")


@dataclass(frozen=True)
class SandboxSnapshot:
    """A sandbox's filesystem state as its provider keeps it until ``delete_snapshot``: a descriptor.

    ``snapshot_id`` is the provider's own id, ``provider`` its ``name``, ``created`` seconds since the
    epoch, ``size_bytes`` what the snapshot holds (the files' sizes, not the disk it costs), ``metadata``
    the string labels given to ``snapshot`` (and stamped by layers such as ``OwnershipMiddleware``).
    It pickles and round-trips through JSON (``to_dict``/``from_dict``), so another process on the
    provider's host (a Ray worker) can ``create(spec, from_snapshot=...)`` from it. A descriptor is
    not a credential: the provider checks it against its own record and refuses one that does not
    match (``SandboxSnapshotNotFoundError``).
    """

    snapshot_id: str
    provider: str
    created: float
    size_bytes: int
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("snapshot_id", "provider"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise SandboxValueError(f"SandboxSnapshot.{name} must be a non-empty string, got {value!r}")
        if isinstance(self.created, bool) or not isinstance(self.created, (int, float)):
            raise SandboxValueError(f"SandboxSnapshot.created must be seconds since the epoch, got {self.created!r}")
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int) or self.size_bytes < 0:
            raise SandboxValueError(f"SandboxSnapshot.size_bytes must be an int >= 0, got {self.size_bytes!r}")
        if not isinstance(self.metadata, Mapping) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in self.metadata.items()
        ):
            raise SandboxValueError(f"SandboxSnapshot.metadata must map strings to strings, got {self.metadata!r}")
        object.__setattr__(self, "created", float(self.created))
        object.__setattr__(self, "metadata", dict(self.metadata))

    def to_dict(self) -> dict[str, Any]:
        """The descriptor as JSON-serializable values (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxSnapshot:
        """A descriptor from ``to_dict``'s mapping; a missing or unknown key is a ``SandboxValueError``."""
        if not isinstance(data, Mapping):
            raise SandboxValueError(f"a snapshot descriptor must be a mapping, not {type(data).__name__}")
        missing = [name for name in _SNAPSHOT_FIELDS[:-1] if name not in data]
        unknown = sorted(set(map(str, data)) - set(_SNAPSHOT_FIELDS))
        if missing or unknown:
            raise SandboxValueError(
                f"a snapshot descriptor has the keys {', '.join(_SNAPSHOT_FIELDS)}"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        return cls(**{name: data[name] for name in _SNAPSHOT_FIELDS if name in data})


@runtime_checkable
class SupportsSandboxSnapshot(Protocol):
    """Snapshots of a sandbox's filesystem, and sandboxes made from them.

    A provider with this capability also takes ``create(spec, from_snapshot=snapshot)``: a new
    sandbox made from ``spec`` as usual (image, limits, env, TTL) whose filesystem starts as the
    snapshot's. It is the one ``create`` operation, so every layer retries, admits, stamps, counts and
    times it like any create (``Operation.extensions["from_snapshot"]``).

    ``snapshot`` takes the state of the sandbox's working directory, or of ``paths`` (relative to the
    working directory, or absolute inside the sandbox; a path that leaves the sandbox is a
    ``SandboxPathError``), symlinks kept as links, while the sandbox runs; each provider documents
    whether the copy is consistent as of one moment. No process state is kept. ``delete_snapshot``
    frees it (a snapshot it does not hold: ``SandboxSnapshotNotFoundError``); ``list_snapshots``
    lists those whose metadata contains every item of ``metadata``, including those of other
    processes (what ``reap`` removes).
    """

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot: ...

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None: ...

    async def list_snapshots(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxSnapshot]: ...


def snapshot_capable(provider: object, action: str) -> SupportsSandboxSnapshot:
    """``provider`` as a ``SupportsSandboxSnapshot``, or the ``SandboxSnapshotError`` that says it is not one."""
    if isinstance(provider, SupportsSandboxSnapshot):
        return provider
    raise SandboxSnapshotError(
        f"cannot {action}: provider {getattr(provider, 'name', '?')!r} ({type(provider).__name__}) takes no "
        "snapshots (no SupportsSandboxSnapshot); LocalProvider and DockerProvider do"
    )


CAPABILITIES: tuple[type, ...] = (
    SupportsSandboxEndpoint,
    ConnectableProvider,
    SupportsSandboxPty,
    SupportsSandboxPtyAttach,
    SupportsSandboxPauseResume,
    SupportsSandboxNetwork,
    SupportsSandboxPortForwarding,
    SupportsSandboxSharedStorage,
    SupportsSandboxRuntimeRequirements,
    SupportsSandboxBackgroundServices,
    SupportsSandboxList,
    SupportsSandboxSnapshot,
)
"""Every optional capability; a layer forwards each exactly when its inner provider has it."""
