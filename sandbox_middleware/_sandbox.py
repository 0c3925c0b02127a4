"""The ``Sandbox`` facade: one sandbox's lifecycle as an async context manager."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._errors import SandboxError, SandboxNotStartedError
from ._protocol import SandboxExecResult, SandboxHandle, SandboxProvider, SandboxSpec, SandboxStatus

__all__ = ["Sandbox", "close_shielded"]

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
    ) -> None:
        self.provider = provider
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
                handle = await self.provider.create(self.spec)
        else:
            handle = await self.provider.create(self.spec)
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
