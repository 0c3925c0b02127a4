"""``FaultInjectingProvider``: an in-process provider that fails, lags and hangs on request."""

from __future__ import annotations

import builtins
import random
import time
import uuid
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, cast

import anyio
import anyio.to_thread

from .._core import OPERATIONS as OPERATIONS  # re-exported by sandbox_middleware.testing
from .._core import Operation, ProviderMiddleware
from .._errors import (
    InjectedCreateError,
    InjectedFault,
    SandboxError,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
)
from .._protocol import (
    SandboxExecResult,
    SandboxHandle,
    SandboxListing,
    SandboxProvider,
    SandboxSnapshot,
    SandboxSpec,
    SandboxStatus,
    SupportsSandboxSnapshot,
)

T = TypeVar("T")

SNAPSHOT_OPERATIONS = ("snapshot", "delete_snapshot")
"""The snapshot capability's calls that take faults, latency and hang points like the six operations
(where the provider has the capability: in memory, or a real provider that takes snapshots)."""
_FAULTABLE = (*OPERATIONS, *SNAPSHOT_OPERATIONS)

_ON_A_LIVE_SANDBOX = frozenset({"exec", "upload", "download", "snapshot"})
"""The operations that fail with SandboxNotFoundError on a sandbox that is not alive."""

FAULT_STREAM: ContextVar[str] = ContextVar("sandbox_middleware_fault_stream", default="")
"""The stream of random choices the calls of this context draw from (``sandbox-middleware run`` sets
``"session N"`` in each session): with one stream per session, which faults land on a session depends on
the seed and the session alone, never on which of the sessions running at once called first."""


class FaultInjectingProvider(ProviderMiddleware):
    """A provider whose sandboxes live in memory, with faults injected on request.

    - ``failure_rates``: probability per operation (create, exec, upload, download, status,
      close, and the snapshot calls ``snapshot`` and ``delete_snapshot``) that the call raises
      ``InjectedFault`` (``InjectedCreateError`` for create) before it has any effect.
    - ``lost_create_rate``: probability that create really creates the sandbox and then raises
      (the response was lost): the sandbox exists but nobody holds its handle.
    - ``close_failures``: each sandbox's first N closes raise, the next one succeeds.
    - ``latency``: seconds each operation waits (anyio.sleep) before its effect.
    - ``hang_at``: await points, ``"operation:before"`` or ``"operation:after"`` (after the
      effect), where the call waits forever, so the caller's cancel scope cancels it right there.

    With ``inner`` (a real provider) the effects happen there and the faults are injected in front
    of it (``sandbox-middleware run --faults``), and it has the capabilities ``inner`` has. Without
    it, each sandbox is an in-memory filesystem: uploads are kept and downloads give them back,
    commands echo and change nothing; ``list`` lists the sandboxes with their ``spec.metadata``
    (``SupportsSandboxList``), and ``snapshot`` copies the files under the working directory
    (``spec.workdir``, default ``/workspace``) or under ``paths`` into a snapshot held in memory,
    which ``create(spec, from_snapshot=...)`` starts a sandbox's files from
    (``SupportsSandboxSnapshot``; consistent as of one moment). A snapshot descriptor whose id,
    provider or metadata differs from the record, or one deleted, is a ``SandboxSnapshotNotFoundError``;
    a path that climbs out of the sandbox's root a ``SandboxPathError``.

    Ground truth: ``alive`` is the set of sandbox ids that really exist, ``orphaned`` those created
    by a lost or cancelled create whose handle never reached the caller, ``snapshots`` the ids of the
    snapshots taken through this injector and not deleted, ``injected`` every fault raised. ``seed``
    makes the random choices reproducible: the n-th call of an operation in a stream
    (``FAULT_STREAM``; a call on a sandbox outside any stream draws from the stream that created it) is
    failed or not by ``(seed, stream, operation, n)`` alone, whatever else runs at the same time.
    """

    def __init__(
        self,
        inner: SandboxProvider | None = None,
        *,
        name: str = "faulty",
        seed: int = 0,
        failure_rates: Mapping[str, float] | None = None,
        lost_create_rate: float = 0.0,
        close_failures: int = 0,
        latency: Mapping[str, float] | None = None,
        hang_at: Collection[str] = (),
    ) -> None:
        rates = dict(failure_rates or {})
        unknown = set(rates) | set(latency or {}) | {point.split(":")[0] for point in hang_at}
        unknown -= set(_FAULTABLE)
        if unknown:
            raise ValueError(f"FaultInjectingProvider: unknown operation(s) {sorted(unknown)}; use {_FAULTABLE}")
        for operation, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(
                    f"FaultInjectingProvider: failure rate for {operation!r} must be in [0, 1], not {rate}"
                )
        self.alive: set[str] = set()
        self.snapshots: set[str] = set()
        # With inner, its optional capabilities (list, connect ...) pass through; without, sandboxes live in memory.
        super().__init__(inner if inner is not None else _Sandboxes(name, self.alive))
        self.failure_rates = rates
        self.lost_create_rate = lost_create_rate
        self.close_failures = close_failures
        self.latency = dict(latency or {})
        self.hang_at = frozenset(hang_at)
        self.seed = seed
        self._draws: dict[tuple[str, str], int] = {}  # (stream, operation): calls so far
        self._streams: dict[str, str] = {}  # sandbox id: the stream of the create that made it
        self.orphaned: set[str] = set()
        self.injected: list[InjectedFault] = []
        self.calls: dict[str, int] = dict.fromkeys(_FAULTABLE, 0)
        self._close_attempts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"FaultInjectingProvider(name={self.name!r}, alive={len(self.alive)})"

    async def _enter(self, operation: str, sandbox_id: str | None) -> None:
        """The 'before' await point: latency, hang, injected failure, liveness."""
        self.calls[operation] += 1
        delay = self.latency.get(operation)
        if delay:
            await anyio.sleep(delay)
        else:
            await anyio.lowlevel.checkpoint()
        if f"{operation}:before" in self.hang_at:
            await anyio.sleep_forever()
        rate = self.failure_rates.get(operation)
        if rate and self._chance(operation, sandbox_id) < rate:
            self._raise(operation, f"injected {operation} failure")
        if operation in _ON_A_LIVE_SANDBOX and sandbox_id is not None and sandbox_id not in self.alive:
            raise SandboxNotFoundError(f"{self.name}: no live sandbox {sandbox_id!r}")

    async def _leave(self, operation: str) -> None:
        """The 'after' await point, once the operation took effect."""
        if f"{operation}:after" in self.hang_at:
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()

    def _chance(self, draw: str, sandbox_id: str | None) -> float:
        """The next random number of ``draw`` (an operation, or ``lost_create``) in this call's stream."""
        stream = FAULT_STREAM.get() or self._streams.get(sandbox_id or "", "")
        n = self._draws.get((stream, draw), 0)
        self._draws[(stream, draw)] = n + 1
        return random.Random(f"{self.seed}/{stream}/{draw}/{n}").random()

    def _raise(self, operation: str, message: str) -> None:
        error = InjectedCreateError(message) if operation == "create" else InjectedFault(message)
        self.injected.append(error)
        raise error

    async def around(self, operation: Operation[T]) -> T:
        name, handle = operation.name, operation.handle
        sandbox_id = handle.sandbox_id if handle is not None else None
        await self._enter(name, sandbox_id)
        if handle is not None and name == "close":
            attempts = self._close_attempts.get(handle.sandbox_id, 0)
            if attempts < self.close_failures and handle.sandbox_id in self.alive:
                self._close_attempts[handle.sandbox_id] = attempts + 1
                self._raise("close", f"injected close failure {attempts + 1}/{self.close_failures}")
        result = await operation()
        created = cast("SandboxHandle", result).sandbox_id if name == "create" else None
        if created is not None:
            self.alive.add(created)
            self.orphaned.add(created)  # until the handle is handed back
            self._streams[created] = FAULT_STREAM.get()
            if self.lost_create_rate and self._chance(LOST_CREATE, None) < self.lost_create_rate:
                self._raise("create", f"injected lost response: {created} was created")
        elif handle is not None and name == "close":
            self._close_attempts.pop(handle.sandbox_id, None)
            self.alive.discard(handle.sandbox_id)
            self._streams.pop(handle.sandbox_id, None)
        await self._leave(name)
        if created is not None:
            self.orphaned.discard(created)
        return result

    # The snapshot capability's calls (gone, like every capability, where ``inner`` has none).

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        await self._enter("snapshot", handle.sandbox_id)
        taken = await cast("SupportsSandboxSnapshot", self.inner).snapshot(handle, paths=paths, metadata=metadata)
        self.snapshots.add(taken.snapshot_id)
        await self._leave("snapshot")
        return taken

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        await self._enter("delete_snapshot", None)
        await cast("SupportsSandboxSnapshot", self.inner).delete_snapshot(snapshot)
        self.snapshots.discard(snapshot.snapshot_id)
        await self._leave("delete_snapshot")

    async def aclose(self) -> None:
        await self.inner.aclose()
        await anyio.lowlevel.checkpoint()


_DEFAULT_WORKDIR = "/workspace"
_NO_METADATA: Mapping[str, str] = MappingProxyType({})


def _inside(workdir: str, path: str, sandbox_id: str) -> str:
    """``path`` (absolute, or relative to ``workdir``) as a normal absolute path in the sandbox; one whose
    ``..`` climbs above the sandbox's root is a ``SandboxPathError``."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxPathError(f"sandbox {sandbox_id!r}: {path!r} is not a path (a non-empty string without NUL)")
    parts: list[str] = []
    for part in (path if path.startswith("/") else f"{workdir}/{path}").split("/"):
        if part == "..":
            if not parts:
                raise SandboxPathError(f"sandbox {sandbox_id!r}: {path!r} leaves the sandbox (its '..' climbs out)")
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


def _under(files: Mapping[str, bytes], path: str) -> dict[str, bytes]:
    """The files at ``path`` or below it."""
    prefix = path.rstrip("/") + "/"
    return {name: data for name, data in files.items() if name == path or name.startswith(prefix)}


@dataclass(slots=True)
class _Box:
    """One in-memory sandbox: its working directory, metadata, creation time and files (path -> bytes).
    Small: a test holds ten thousand of them."""

    workdir: str
    metadata: Mapping[str, str]
    created: float
    files: dict[str, bytes] = field(default_factory=dict)


class _Sandboxes:
    """FaultInjectingProvider's provider when it wraps none: each sandbox an in-memory filesystem whose
    id is in ``alive`` (the set the fault injector keeps), commands echo; snapshots held in memory."""

    def __init__(self, name: str, alive: set[str]) -> None:
        self.name = name
        self.alive = alive
        self._ids = 0  # an int, not itertools.count: providers pickle (3.14 drops itertools pickling)
        self._boxes: dict[str, _Box] = {}
        self._snapshots: dict[str, tuple[SandboxSnapshot, dict[str, bytes]]] = {}

    def _box(self, handle: SandboxHandle) -> _Box:
        box = self._boxes.get(handle.sandbox_id)
        if box is None:
            raise SandboxNotFoundError(f"{self.name}: no live sandbox {handle.sandbox_id!r}")
        return box

    def _held(self, snapshot: object) -> dict[str, bytes]:
        """The files of the snapshot ``snapshot`` describes, checked against the record of it."""
        if not isinstance(snapshot, SandboxSnapshot):
            raise SandboxSnapshotError(f"{self.name}: a snapshot is a SandboxSnapshot, not {type(snapshot).__name__}")
        record, files = self._snapshots.get(snapshot.snapshot_id, (None, {}))
        if record is None or (snapshot.provider, dict(snapshot.metadata)) != (record.provider, record.metadata):
            raise SandboxSnapshotNotFoundError(
                f"{self.name}: no snapshot {snapshot.snapshot_id!r} of provider {snapshot.provider!r} with that "
                "metadata is held here (never taken here, taken by another provider, deleted, or altered)"
            )
        return files

    async def create(self, spec: SandboxSpec, *, from_snapshot: SandboxSnapshot | None = None) -> SandboxHandle:
        files = self._held(from_snapshot) if from_snapshot is not None else {}
        self._ids += 1
        sandbox_id = f"{self.name}-{self._ids - 1}"
        metadata = dict(spec.metadata) if spec.metadata else _NO_METADATA
        self._boxes[sandbox_id] = _Box(spec.workdir or _DEFAULT_WORKDIR, metadata, time.time(), dict(files))
        return SandboxHandle(sandbox_id, self.name, None)

    async def exec(self, handle: SandboxHandle, command: str, **options: Any) -> SandboxExecResult:
        return SandboxExecResult(f"ran: {command}\n", "", 0)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        box = self._box(handle)
        target = _inside(box.workdir, target_path, handle.sandbox_id)
        try:
            box.files[target] = await anyio.to_thread.run_sync(Path(source_path).read_bytes)
        except OSError as exc:
            raise SandboxError(f"{self.name}: source {source_path} is not a readable file: {exc}") from exc

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        box = self._box(handle)
        source = _inside(box.workdir, source_path, handle.sandbox_id)
        if source not in box.files:
            raise SandboxError(f"{self.name}: {source_path!r} is not a file in sandbox {handle.sandbox_id!r}")
        await anyio.to_thread.run_sync(Path(target_path).write_bytes, box.files[source])

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus.RUNNING if handle.sandbox_id in self.alive else SandboxStatus.STOPPED

    async def close(self, handle: SandboxHandle) -> None:
        self._boxes.pop(handle.sandbox_id, None)

    async def list(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxListing]:
        wanted = dict(metadata or {}).items()
        return [
            SandboxListing(SandboxHandle(sandbox_id, self.name, None), dict(box.metadata), box.created)
            for sandbox_id, box in self._boxes.items()
            if wanted <= box.metadata.items()
        ]

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: builtins.list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        box = self._box(handle)
        files: dict[str, bytes] = {}
        for path in paths if paths is not None else [box.workdir]:
            inside = _inside(box.workdir, path, handle.sandbox_id)
            found = _under(box.files, inside)
            if not found and paths is not None:
                raise SandboxSnapshotError(f"{self.name}: {path!r} names no file in sandbox {handle.sandbox_id!r}")
            files.update(found)
        size = sum(len(data) for data in files.values())
        snapshot_id = f"{self.name}-snap-{uuid.uuid4().hex[:12]}"
        taken = SandboxSnapshot(snapshot_id, self.name, time.time(), size, metadata or {})
        self._snapshots[taken.snapshot_id] = (taken, files)
        return taken

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        self._held(snapshot)
        del self._snapshots[snapshot.snapshot_id]

    async def list_snapshots(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxSnapshot]:
        wanted = dict(metadata or {}).items()
        return [record for record, _ in self._snapshots.values() if wanted <= record.metadata.items()]

    async def aclose(self) -> None:
        pass


LOST_CREATE = "lost_create"
"""The fault name of ``lost_create_rate`` in ``parse_faults`` (create succeeds, its response is lost)."""


def parse_faults(spec: str) -> dict[str, float]:
    """``"create=0.1,close=0.05,lost_create=0.1"`` as rates; a ``ValueError`` says what is wrong.

    Operation names (and ``snapshot``, ``delete_snapshot``) are failure rates; ``lost_create`` is
    ``lost_create_rate``.
    """
    rates: dict[str, float] = {}
    names = (*_FAULTABLE, LOST_CREATE)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        operation, sep, value = part.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not sep or operation not in names or not 0.0 <= rate <= 1.0:
            raise ValueError(
                f"bad fault {part!r}: use name=probability with name one of {', '.join(names)} "
                "and probability in [0, 1], e.g. create=0.1,close=0.05,lost_create=0.1"
            )
        rates[operation] = rate
    return rates
