"""The ``Sandbox`` facade: one sandbox's lifecycle as an async context manager."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._errors import SandboxError, SandboxNotStartedError, SandboxValueError
from ._groups import create_group
from ._protocol import (
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxSnapshot,
    SandboxSpec,
    SandboxStatus,
    SupportsSandboxSnapshot,
    snapshot_capable,
)

__all__ = ["Forks", "Sandbox", "close_shielded"]

logger = logging.getLogger("sandbox_middleware")

DEFAULT_CLOSE_TIMEOUT_S = 60.0
DEFAULT_CREATE_TIMEOUT_S = 600.0


async def close_shielded(provider: SandboxProvider, handle: SandboxHandle, timeout_s: float) -> None:
    """Close ``handle``, shielded from cancellation and bounded by ``timeout_s`` (``TimeoutError``)."""
    with anyio.CancelScope(shield=True), anyio.fail_after(timeout_s):
        await provider.close(handle)


class Sandbox:
    """One sandbox: ``async with Sandbox(provider, spec) as sb: await sb.exec("pytest")``.

    ``start()`` creates the sandbox, writes ``spec.files`` (sandbox path -> text contents, as in
    NeMo Gym) and uploads ``local_files`` (sandbox path -> a local file's path); if anything after create fails or
    is cancelled, the sandbox is closed (shielded from cancellation, bounded by
    ``close_timeout_s``) and the original error propagates. ``stop()`` closes it; a close the
    provider rejected leaves the sandbox started, so a later ``stop()`` retries it.

    A create cancelled half-way may leave a sandbox that nobody holds a handle to. With
    ``shield_create`` (the default) the create call is shielded from cancellation, bounded by
    ``create_timeout_s`` (default ``spec.ready_timeout_s``, else 600 s): a cancellation that
    arrives meanwhile takes effect once the handle is back, and the sandbox is closed first. The
    price is that cancelling a session waits for its in-flight create.

    ``from_snapshot`` makes the sandbox from a ``SandboxSnapshot`` (``create(spec, from_snapshot=...)``
    of a ``SupportsSandboxSnapshot`` provider); ``snapshot()`` takes one of this sandbox and
    ``fork(n)`` makes ``n`` sandboxes from one.
    """

    def __init__(
        self,
        provider: SandboxProvider,
        spec: SandboxSpec | None = None,
        *,
        close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
        shield_create: bool = True,
        create_timeout_s: float | None = None,
        local_files: Mapping[str, str | Path] | None = None,
        from_snapshot: SandboxSnapshot | None = None,
    ) -> None:
        self.provider = provider
        self.from_snapshot = from_snapshot
        self.spec = spec if spec is not None else SandboxSpec()
        self.local_files = {target: Path(source) for target, source in (local_files or {}).items()}
        self.close_timeout_s = close_timeout_s
        self.shield_create = shield_create
        ready = self.spec.ready_timeout_s
        self.create_timeout_s = (
            create_timeout_s if create_timeout_s is not None else (ready or DEFAULT_CREATE_TIMEOUT_S)
        )
        self._handle: SandboxHandle | None = None

    @property
    def handle(self) -> SandboxHandle:
        if self._handle is None:
            raise SandboxNotStartedError("this Sandbox is not started (or already stopped); call start() first")
        return self._handle

    @property
    def started(self) -> bool:
        return self._handle is not None

    async def start(self) -> SandboxHandle:
        if self._handle is not None:
            raise SandboxError(f"sandbox {self._handle.sandbox_id!r} is already started")
        if self.shield_create:
            with anyio.CancelScope(shield=True), anyio.fail_after(self.create_timeout_s):
                handle = await self._create()
        else:
            handle = await self._create()
        self._handle = handle
        try:
            await anyio.lowlevel.checkpoint()  # a cancellation that arrived during the shielded create lands here
            if self.spec.files:
                await self._write_files(handle)
            for target, source in self.local_files.items():
                await self.provider.upload_file(handle, source, target)
        except BaseException:
            await self._stop_after_failure()
            raise
        return handle

    async def _create(self) -> SandboxHandle:
        if self.from_snapshot is None:
            return await self.provider.create(self.spec)
        snapshot_capable(self.provider, "create a sandbox from a snapshot")
        return await self.provider.create(self.spec, from_snapshot=self.from_snapshot)  # type: ignore[call-arg]

    async def _write_files(self, handle: SandboxHandle) -> None:
        """``spec.files``: each text written to a local temporary file, uploaded, then removed."""
        folder = Path(await anyio.to_thread.run_sync(tempfile.mkdtemp, "", "sandbox-middleware-files-"))
        try:
            for index, (target, contents) in enumerate(self.spec.files.items()):
                source = folder / f"file-{index}"
                await anyio.to_thread.run_sync(source.write_text, contents, "utf-8")
                await self.provider.upload_file(handle, source, target)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shutil.rmtree, folder, True)

    async def _stop_after_failure(self) -> None:
        """Stop while another error is propagating: log a failed close, never replace that error."""
        try:
            await self.stop()
        except Exception:
            handle = self._handle
            logger.warning(
                "could not close sandbox %s after a failure; it is still held",
                handle.sandbox_id if handle else "?",
                exc_info=True,
            )

    async def stop(self) -> None:
        """Close the sandbox (shielded, bounded); a no-op when it is not started."""
        handle = self._handle
        if handle is None:
            return
        await close_shielded(self.provider, handle, self.close_timeout_s)
        self._handle = None

    async def exec(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        user: str | int | None = None,
        **extensions: Any,
    ) -> SandboxExecResult:
        """Run ``command``; provider-specific keyword arguments (``stdin=``) go to the provider as they are."""
        return await self.provider.exec(
            self.handle, command, cwd=cwd, env=env, timeout_s=timeout_s, user=user, **extensions
        )

    async def upload(self, source_path: str | Path, target_path: str) -> None:
        await self.provider.upload_file(self.handle, Path(source_path), target_path)

    async def download(self, source_path: str, target_path: str | Path) -> None:
        await self.provider.download_file(self.handle, source_path, Path(target_path))

    async def status(self) -> SandboxStatus:
        return await self.provider.status(self.handle)

    async def snapshot(
        self, *, paths: list[str] | None = None, metadata: Mapping[str, str] | None = None
    ) -> SandboxSnapshot:
        """A snapshot of this sandbox's filesystem (its working directory, or ``paths``); the caller
        deletes it (``delete_snapshot``) or ``reap`` does, once this run is over."""
        provider = snapshot_capable(self.provider, "take a snapshot")
        return await provider.snapshot(self.handle, paths=paths, metadata=metadata)

    def fork(
        self,
        n: int,
        spec: SandboxSpec | None = None,
        *,
        keep_snapshot: bool = False,
        paths: list[str] | None = None,
    ) -> Forks:
        """``n`` new sandboxes whose filesystem starts as this one's now: one snapshot, ``n`` creates
        from it at once. Each is made from ``spec`` (default: this sandbox's spec without its
        ``files``, which the snapshot already holds), so its limits, env and TTL are its own.

        ``forks = await sandbox.fork(8)`` gives the started ``Sandbox`` objects (the caller stops
        each); ``async with sandbox.fork(8) as forks:`` also stops them all on the way out. The
        snapshot is deleted once the last fork is made, unless ``keep_snapshot`` (``Forks.snapshot``
        then holds it). If any create fails or is cancelled, or the snapshot's delete fails, the forks
        made are closed and the snapshot deleted (shielded, bounded by ``close_timeout_s``) before the
        error propagates.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SandboxValueError(f"Sandbox.fork(n): n must be an int >= 1, got {n!r}")
        return Forks(self, n, spec, keep_snapshot=keep_snapshot, paths=paths)

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.stop()
        else:
            await self._stop_after_failure()


class Forks:
    """What ``Sandbox.fork`` returns: awaited, the list of started forks; entered, the same list,
    every fork stopped on exit (shielded, bounded). ``snapshot`` is the snapshot they were made from
    while it is kept (``keep_snapshot=True``), else None once the forks are made."""

    def __init__(
        self, parent: Sandbox, n: int, spec: SandboxSpec | None, *, keep_snapshot: bool, paths: list[str] | None
    ) -> None:
        self._parent = parent
        self._n = n
        self._spec = spec if spec is not None else dataclasses.replace(parent.spec, files={})
        self._keep = keep_snapshot
        self._paths = paths
        self.snapshot: SandboxSnapshot | None = None
        self.sandboxes: list[Sandbox] = []

    def __await__(self) -> Generator[Any, None, list[Sandbox]]:
        return self._make().__await__()

    async def _make(self) -> list[Sandbox]:
        if self.sandboxes:
            raise SandboxError("these forks are already made; fork again for more")
        parent = self._parent
        provider = snapshot_capable(parent.provider, "fork a sandbox")
        snapshot = await provider.snapshot(parent.handle, paths=self._paths)
        forks = [
            Sandbox(
                parent.provider,
                self._spec,
                close_timeout_s=parent.close_timeout_s,
                shield_create=parent.shield_create,
                create_timeout_s=parent.create_timeout_s,
                from_snapshot=snapshot,
            )
            for _ in range(self._n)
        ]
        try:
            group_of = create_group(self._n, parent.close_timeout_s, parent.handle.sandbox_id)
            async with group_of as group:  # admitted as one (_groups.py)

                async def start(fork: Sandbox) -> None:
                    await fork.start()
                    group.made += 1

                await _all(functools.partial(start, fork) for fork in forks)
            if not self._keep:  # failing, it would leave the forks made where no caller can reach them
                await self._delete(provider, snapshot)
        except BaseException:
            await self._undo(provider, forks, snapshot)
            raise
        if self._keep:
            self.snapshot = snapshot
        self.sandboxes = forks
        return forks

    async def _undo(self, provider: SupportsSandboxSnapshot, forks: list[Sandbox], snapshot: SandboxSnapshot) -> None:
        """After a failed fork: every fork made is stopped and the snapshot deleted; their own failures
        are logged, never raised over the error that is propagating."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for fork in forks:
                    group.start_soon(fork._stop_after_failure)
            try:
                await self._delete(provider, snapshot)
            except Exception:
                logger.warning("could not delete snapshot %s after a failed fork", snapshot.snapshot_id, exc_info=True)

    async def _delete(self, provider: SupportsSandboxSnapshot, snapshot: SandboxSnapshot) -> None:
        with anyio.CancelScope(shield=True), anyio.fail_after(self._parent.close_timeout_s):
            await provider.delete_snapshot(snapshot)

    async def __aenter__(self) -> list[Sandbox]:
        return await self._make()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await _all(fork.stop if exc is None else fork._stop_after_failure for fork in self.sandboxes)


async def _all(calls: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Run ``calls`` at once; the first to fail cancels the rest (a shielded create or stop finishes
    first) and its error is raised as it is, not in an ``ExceptionGroup``, so ``except
    SandboxCreateError`` catches a failed fork."""
    failures: list[Exception] = []

    async def run(call: Callable[[], Awaitable[object]], scope: anyio.CancelScope) -> None:
        try:
            await call()
        except Exception as exc:
            failures.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as group:
        for call in calls:
            group.start_soon(run, call, group.cancel_scope)
    if failures:
        raise failures[0]
