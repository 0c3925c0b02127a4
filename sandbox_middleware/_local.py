"""``LocalProvider``: real sandboxes on this machine, a directory and a process group each."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread

from ._protocol import (
    SandboxCreateError,
    SandboxEndpoint,
    SandboxError,
    SandboxExecResult,
    SandboxHandle,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSpec,
    SandboxStatus,
)

__all__ = ["BwrapUnavailableError", "LocalProvider"]

Isolation = Literal["none", "bwrap"]


class BwrapUnavailableError(SandboxError):
    """``isolation="bwrap"`` was asked for where the ``bwrap`` executable is not installed."""


@dataclass
class _Box:
    root: Path
    control: Path
    env: dict[str, str]
    cwd: Path
    ports: tuple[int, ...]
    groups: set[int] = field(default_factory=set)


class LocalProvider:
    """Sandboxes on this machine: each one a fresh directory, each command ``bash -c`` in it.

    Every command runs in its own process group; a timeout kills the whole group and returns a
    result with ``error_type="timeout"``; ``close`` kills what still runs and removes the
    directory. Paths given to ``upload_file`` / ``download_file`` resolve inside the sandbox
    directory (relative ones against it) and may not leave it.

    ``isolation="bwrap"`` runs each command under bubblewrap: no network, separate PID namespace,
    read-only root, the sandbox directory bound read-write at its own path as the work directory.
    ``spec.image`` is ignored (this machine is the image); ``spec.entrypoint`` is refused.
    """

    name = "local"

    def __init__(self, *, isolation: Isolation = "none", base_dir: str | Path | None = None) -> None:
        if isolation not in ("none", "bwrap"):
            raise ValueError(f"LocalProvider: isolation must be 'none' or 'bwrap', not {isolation!r}")
        self._bwrap: str | None = None
        if isolation == "bwrap":
            self._bwrap = shutil.which("bwrap")
            if self._bwrap is None:
                raise BwrapUnavailableError(
                    "LocalProvider(isolation='bwrap'): no 'bwrap' executable on PATH; install "
                    "bubblewrap (apt-get install -y bubblewrap) or use isolation='none'"
                )
        self.isolation: Isolation = isolation
        self._base = Path(base_dir) if base_dir is not None else None
        self._boxes: dict[str, _Box] = {}

    def __repr__(self) -> str:
        return f"LocalProvider(isolation={self.isolation!r})"

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.entrypoint:
            raise SandboxCreateError("LocalProvider does not run entrypoints; start the process with exec()")
        sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        try:
            root, control, cwd = await anyio.to_thread.run_sync(self._make_dirs, sandbox_id, spec.workdir)
        except OSError as exc:
            raise SandboxCreateError(f"LocalProvider: cannot create a sandbox directory: {exc}") from exc
        self._boxes[sandbox_id] = _Box(root, control, dict(spec.env), cwd, tuple(spec.ports))
        return SandboxHandle(sandbox_id, self.name, {"root": str(root)})

    def _make_dirs(self, sandbox_id: str, workdir: str | None) -> tuple[Path, Path, Path]:
        if self._base is not None:
            self._base.mkdir(parents=True, exist_ok=True)
        outer = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._base)).resolve()
        root, control = outer / "box", outer / "control"
        root.mkdir()
        control.mkdir()
        cwd = self._inside(root, workdir) if workdir else root
        cwd.mkdir(parents=True, exist_ok=True)
        return root, control, cwd

    def _box(self, handle: SandboxHandle) -> _Box:
        box = self._boxes.get(handle.sandbox_id)
        if box is None:
            raise SandboxNotFoundError(
                f"LocalProvider: no live sandbox {handle.sandbox_id!r} (never created here, or closed)"
            )
        return box

    @staticmethod
    def _inside(root: Path, path: str) -> Path:
        """``path`` resolved inside ``root`` (symlinks followed), or ``SandboxPathError``."""
        candidate = Path(path)
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not resolved.is_relative_to(root):
            raise SandboxPathError(
                f"path {path!r} resolves to {resolved}, outside the sandbox directory {root}; "
                "use a path inside the sandbox"
            )
        return resolved

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        box = self._box(handle)
        if user is not None:
            raise SandboxError("LocalProvider runs commands as the current user; user= is not supported")
        workdir = self._inside(box.root, cwd) if cwd is not None else box.cwd
        if not await anyio.to_thread.run_sync(workdir.is_dir):
            raise SandboxError(
                f"LocalProvider: cwd {cwd!r} is not a directory in sandbox {handle.sandbox_id!r}; create it first"
            )
        child_env = {**os.environ, **box.env, **(env or {})}
        argv = ["bash", "-c", command]
        if self._bwrap is not None:
            argv = [
                self._bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--tmpfs", "/tmp", "--bind", str(box.root), str(box.root),
                "--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent",
                "--chdir", str(workdir), *argv,
            ]  # fmt: skip
        # Output goes to files, not pipes: a background child that keeps the pipe open would
        # otherwise hold the call until it exits.
        token = uuid.uuid4().hex
        out_path, err_path = box.control / f"{token}.out", box.control / f"{token}.err"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = await anyio.open_process(
                argv, stdin=None, stdout=out, stderr=err, cwd=workdir, env=child_env, start_new_session=True
            )
        box.groups.add(process.pid)
        timed_out = False
        try:
            with anyio.move_on_after(timeout_s) as scope:
                await process.wait()
            if scope.cancelled_caught:
                timed_out = True
                _kill_group(process.pid)
                with anyio.CancelScope(shield=True):
                    await process.wait()
        except BaseException:
            _kill_group(process.pid)
            with anyio.CancelScope(shield=True):
                await process.wait()
            raise
        finally:
            stdout = _read_and_remove(out_path)
            stderr = _read_and_remove(err_path)
        if not _group_alive(process.pid):
            box.groups.discard(process.pid)
        if timed_out:
            return SandboxExecResult(stdout, stderr, process.returncode or -signal.SIGKILL, error_type="timeout")
        assert process.returncode is not None
        return SandboxExecResult(stdout, stderr, process.returncode)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        box = self._box(handle)
        target = self._inside(box.root, target_path)
        try:
            await anyio.to_thread.run_sync(_copy, Path(source_path), target)
        except OSError as exc:
            raise SandboxError(
                f"LocalProvider: cannot upload {source_path} to {target_path!r} in sandbox {handle.sandbox_id!r}: {exc}"
            ) from exc

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        box = self._box(handle)
        source = self._inside(box.root, source_path)
        if not source.is_file():
            raise SandboxError(f"LocalProvider: {source_path!r} is not a file in sandbox {handle.sandbox_id!r}")
        try:
            await anyio.to_thread.run_sync(_copy, source, Path(target_path))
        except OSError as exc:
            raise SandboxError(
                f"LocalProvider: cannot download {source_path!r} from sandbox {handle.sandbox_id!r} "
                f"to {target_path}: {exc}"
            ) from exc

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        box = self._boxes.get(handle.sandbox_id)
        if box is None:
            return SandboxStatus.STOPPED if handle.provider_name == self.name else SandboxStatus.UNKNOWN
        return SandboxStatus.RUNNING if box.root.is_dir() else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        box = self._boxes.pop(handle.sandbox_id, None)
        if box is None:
            return
        for group in box.groups:
            _kill_group(group)
        await anyio.to_thread.run_sync(shutil.rmtree, box.root.parent, True)

    async def aclose(self) -> None:
        for sandbox_id in list(self._boxes):
            await self.close(SandboxHandle(sandbox_id, self.name))

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint:
        box = self._box(handle)
        if self._bwrap is not None:
            raise SandboxError("LocalProvider(isolation='bwrap') has no network; it serves no endpoints")
        if port not in box.ports:
            raise SandboxError(
                f"port {port} was not declared in the spec of sandbox {handle.sandbox_id!r} "
                f"(declared: {list(box.ports)})"
            )
        return SandboxEndpoint(f"http://127.0.0.1:{port}")

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        box = self._box(handle)
        return {
            "provider": self.name,
            "sandbox_id": handle.sandbox_id,
            "root": str(box.root),
            "env": box.env,
            "cwd": str(box.cwd),
            "ports": list(box.ports),
        }

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        try:
            sandbox_id, root = str(descriptor["sandbox_id"]), Path(descriptor["root"])
        except (KeyError, TypeError) as exc:
            raise SandboxError(
                f"LocalProvider.connect: descriptor lacks {exc}; pass serialize_handle()'s output"
            ) from exc
        if not await anyio.to_thread.run_sync(root.is_dir):
            raise SandboxNotFoundError(f"LocalProvider.connect: sandbox {sandbox_id!r} no longer exists at {root}")
        control = root.parent / "control"
        cwd = Path(descriptor.get("cwd") or root)
        self._boxes[sandbox_id] = _Box(
            root, control, dict(descriptor.get("env") or {}), cwd, tuple(descriptor.get("ports") or ())
        )
        return SandboxHandle(sandbox_id, self.name, {"root": str(root)})


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_and_remove(path: Path) -> str:
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
        path.unlink()
    except FileNotFoundError:
        return ""
    return text


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


# Errors carry their public module, so `error.type` on dashboards reads e.g. sandbox_middleware.SandboxCreateError.
BwrapUnavailableError.__module__ = "sandbox_middleware"
