"""How DockerProvider runs one command: an exec of ``_exec.RUN`` in the container, its multiplexed output
read into bounded captures until it ends or its deadline passes, and then the kill of what it left
(from the host where the provider can, else inside the container: ``_exec.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import PurePosixPath
from typing import Any

import anyio
import httpx

from ..._errors import DockerUnavailableError, SandboxError, SandboxExpiredError, SandboxNotFoundError
from ..._protocol import SandboxExecResult, SandboxHandle
from ._api import EngineAPI, EngineError
from ._container import Box
from ._daemons import Daemon
from ._exec import KILL, RUN, PidReader, cgroup_pids, host_victims, new_marker
from ._streams import Demultiplexer, OutputCapture

__all__ = ["KILL_TIMEOUT_S", "Commands", "stopped"]

logger = logging.getLogger("sandbox_middleware")

KILL_TIMEOUT_S = 10.0
UNPAUSE_SETTLE_S = 2.0  # how long an exec waits out dockerd marking an unpaused container paused again


class Commands:
    """The command runs of one provider's sandboxes, over its daemon connection; output kept at most
    ``max_output`` bytes per stream."""

    def __init__(self, api: EngineAPI, max_output: int, daemon: Daemon) -> None:
        self._api = api
        self._max_output = max_output
        self._daemon = daemon

    async def run(
        self,
        handle: SandboxHandle,
        box: Box,
        command: str,
        env: dict[str, str],
        workdir: PurePosixPath,
        as_user: str,
        deadline: float | None,
    ) -> SandboxExecResult:
        """``command`` in ``box`` as ``as_user`` in ``workdir``, for at most ``deadline`` seconds (None: no limit)."""
        marker = new_marker()
        body = {
            "Cmd": ["/bin/sh", "-c", RUN, "sh", command],
            "Env": [*(f"{name}={value}" for name, value in env.items()), marker],
            "WorkingDir": str(workdir),
            "User": as_user,
            "AttachStdin": False,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
        }
        exec_id = await self._create(handle, box, body)
        out, err = OutputCapture(self._max_output), OutputCapture(self._max_output)
        stderr = PidReader(err)
        timed_out = False
        try:
            with anyio.move_on_after(deadline) as scope:
                await self._stream(exec_id, Demultiplexer(out, stderr))
            timed_out = scope.cancelled_caught
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_S):
                await self._kill(box, marker, stderr.pid, as_user)
            raise
        if timed_out:
            with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_S):
                await self._kill(box, marker, stderr.pid, as_user)
        code, started = await self._ended(exec_id, box)
        if box.closed:
            return SandboxExecResult(out.text(), err.text(), code or -9, error_type="closed")
        if box.is_expired():
            return SandboxExecResult(out.text(), err.text(), code or -9, error_type="expired")
        if timed_out:
            return SandboxExecResult(out.text(), err.text(), code or -9, error_type="timeout")
        if code is None or code >= 128:  # lost, or a signal's: did the whole container stop?
            # runsc's exec exits 128 when the sandbox died under it, before the daemon knows: a moment for that
            patience = 2.0 if code in (None, 128) and not self._daemon.host_pids else 0.0
            stopped_result = await self._stopped(box, out, err, patience)
            if stopped_result is not None:
                return stopped_result
        if code is None:
            return SandboxExecResult(out.text(), err.text(), -1, error_type="sandbox")
        # The runtime's own failure: no process ever ran, so none wrote this. Podman's inspect cannot tell
        # (Pid 0 for every ended exec): there its failure is a result (exit 127, its words on stderr), never forged.
        if not started and code in (126, 127) and self._daemon.exec_pids:
            raise SandboxError(
                f"DockerProvider: cannot start the command in sandbox {handle.sandbox_id[:12]} (cwd {str(workdir)!r}, "
                f"user {as_user!r}): {out.text().strip()[:500]}"
            )
        return SandboxExecResult(out.text(), err.text(), code)

    async def _create(self, handle: SandboxHandle, box: Box, body: dict[str, Any]) -> str:
        what = f"run a command in sandbox {handle.sandbox_id[:12]}"
        try:
            reply = await self._post_exec(box, body, what)
        except EngineError as exc:
            if exc.status == 404:
                if box.is_expired():
                    raise SandboxExpiredError(
                        f"DockerProvider: sandbox {handle.sandbox_id!r} expired (its ttl_s ran out) and its container "
                        "is removed; create a new one"
                    ) from exc
                raise SandboxNotFoundError(
                    f"DockerProvider: sandbox {handle.sandbox_id!r} was removed from under this provider (closed or "
                    "reaped by another process); create a new one"
                ) from exc
            if exc.status == 409 and "is not running" in exc.message:
                info = await self._api.inspect(box.container, f"inspect sandbox {handle.sandbox_id[:12]}")
                raise SandboxNotFoundError(
                    f"DockerProvider: sandbox {handle.sandbox_id!r} is not running: {stopped(info)}; create a new one"
                ) from exc
            if exc.status == 409:
                raise SandboxError(
                    f"DockerProvider: sandbox {handle.sandbox_id!r} cannot run commands now ({exc.message}); a "
                    "paused sandbox runs them after resume()"
                ) from exc
            raise
        return str(reply.json()["Id"])

    async def _post_exec(self, box: Box, body: dict[str, Any], what: str) -> httpx.Response:
        """Make the exec. dockerd applies containerd's "paused" event asynchronously: landing after an
        unpause (resume(), a timed-out command's kill), it marks the container paused again for a moment,
        so a container this provider does not hold paused is given up to ``UNPAUSE_SETTLE_S`` for that."""
        settle = time.monotonic() + UNPAUSE_SETTLE_S
        while True:
            try:
                return await self._api.call("POST", f"/containers/{box.container}/exec", what, body=body)
            except EngineError as exc:
                if exc.status != 409 or "is paused" not in exc.message or box.paused or time.monotonic() >= settle:
                    raise
            await anyio.sleep(0.02)

    async def _stream(self, exec_id: str, demux: Demultiplexer) -> None:
        """Read the exec's output until it ends, or until shortly after its command has exited (a
        background child holding the streams open must not hold the call)."""
        what = f"read the output of exec {exec_id[:12]}"
        start = {"Detach": False, "Tty": False}
        try:
            async with (
                self._api.stream("POST", f"/exec/{exec_id}/start", what, body=start, silent_ok=True) as reply,
                anyio.create_task_group() as tasks,
            ):
                # Neither task lets an error out: the task group would raise it as an ExceptionGroup.

                async def read() -> None:
                    with contextlib.suppress(httpx.HTTPError):  # the stream broke: the exit code tells
                        async for chunk in reply.aiter_raw():
                            demux.feed(chunk)
                    tasks.cancel_scope.cancel()

                async def watch() -> None:
                    await anyio.sleep(0.25)
                    with contextlib.suppress(SandboxError):  # the daemon is going: the read ends by itself
                        while True:
                            if not (await self._info(exec_id)).get("Running"):
                                break
                            await anyio.sleep(0.1)
                        await anyio.sleep(0.05)  # what it wrote last is in flight
                        tasks.cancel_scope.cancel()

                tasks.start_soon(read)
                tasks.start_soon(watch)
        except (httpx.HTTPError, DockerUnavailableError):
            return  # the container went away mid-command (closed, expired, the daemon died): see the exit code

    async def _stopped(
        self, box: Box, out: OutputCapture, err: OutputCapture, patience: float
    ) -> SandboxExecResult | None:
        """Where the container stopped under a command (under gVisor a memory or pids limit kills the
        whole sandbox), asked for up to ``patience`` seconds: ``error_type`` ``"oom"`` or ``"stopped"``,
        the container's exit code, and why on stderr. None while it runs."""
        deadline = time.monotonic() + patience
        while True:
            try:
                info = await self._api.inspect(box.container, "inspect a container that lost a command")
            except DockerUnavailableError:
                return None
            state = (info or {}).get("State") or {}
            if info is None:
                return None
            if not state.get("Running", True):
                # the daemon marks an OOM kill from an event of its own, which may land after the exit's
                if state.get("OOMKilled") or state.get("ExitCode") != 137 or time.monotonic() >= deadline + 1:
                    break
            elif time.monotonic() >= deadline:
                return None
            await anyio.sleep(0.1)
        said = f"{err.text()}[DockerProvider: the sandbox stopped during the command: {stopped(info)}]\n"
        kind = "oom" if state.get("OOMKilled") else "stopped"
        return SandboxExecResult(out.text(), said, int(state.get("ExitCode") or -1), error_type=kind)

    async def _host_pids(self, box: Box, init: int) -> list[int] | None:
        """The host pids of a paused container: its ``top`` (Docker), or its freezer cgroup's list (Podman,
        whose ``top`` forks into the container, and answers nothing while it is frozen)."""
        if self._daemon.kind == "podman":
            return cgroup_pids(init)
        top = (await self._api.call("GET", f"/containers/{box.container}/top", "list a container's processes")).json()
        column = list(top["Titles"]).index("PID")
        return [int(row[column]) for row in top.get("Processes") or []]

    async def _info(self, exec_id: str) -> dict[str, Any]:
        reply = await self._api.call("GET", f"/exec/{exec_id}/json", f"inspect exec {exec_id[:12]}", ok=(404,))
        return {} if reply.status_code == 404 else dict(reply.json())

    async def _ended(self, exec_id: str, box: Box) -> tuple[int | None, bool]:
        """The exec's exit code (None: unknown) and whether its process started, as the daemon says (exec
        inspect: ``Pid`` 0 is a process the runtime never started), never as its output says."""
        for _ in range(20):
            try:
                info = await self._info(exec_id)
            except DockerUnavailableError:
                return None, True
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"]), info.get("Pid") != 0
            if not info or box.closed:
                return None, True
            await anyio.sleep(0.05)
        return None, True

    async def _kill(self, box: Box, marker: str, group: int | None, user: str) -> None:
        """Kill every process of one command: from the host where it can (``_kill_from_host``), else
        inside the container (``_exec.KILL``), as its user."""
        try:
            if await self._kill_from_host(box, marker):
                return
        except (EngineError, DockerUnavailableError, KeyError, TypeError, ValueError) as exc:
            logger.warning("DockerProvider: could not kill a timed-out command from the host: %s", exc)
        body = {
            "Cmd": ["/bin/sh", "-c", KILL, "kill", marker, str(group or "")],
            "User": user,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
        }
        try:
            reply = await self._api.call(
                "POST", f"/containers/{box.container}/exec", "kill a timed-out command", body=body, ok=(404, 409)
            )
            if reply.status_code >= 400:
                return  # gone or paused: nothing runs
            sink = OutputCapture(4096)
            await self._stream(str(reply.json()["Id"]), Demultiplexer(sink, sink))
        except (EngineError, DockerUnavailableError) as exc:
            logger.warning("DockerProvider: could not kill a timed-out command in %s: %s", box.container[:12], exc)

    async def _kill_from_host(self, box: Box, marker: str) -> bool:
        """With the container paused (nothing forks or fights back), SIGKILL the command's processes
        from the host (``_exec.host_victims``), then unpause. False where the provider cannot (not
        root, a daemon elsewhere, the container paused by its user, gVisor)."""
        if os.geteuid() != 0 or not self._daemon.host_pids:
            return False
        info = await self._api.inspect(box.container, "inspect a container to kill a command")
        init = int(((info or {}).get("State") or {}).get("Pid") or 0)
        if info is None or not init or (info.get("State") or {}).get("Paused"):
            return info is None  # gone: nothing runs
        what = f"pause {box.container[:12]} to kill a command"
        reply = await self._api.call("POST", f"/containers/{box.container}/pause", what, ok=(404, 409))
        if reply.status_code >= 400:
            return reply.status_code == 404
        try:
            pids = await self._host_pids(box, init)
            victims = None if pids is None else host_victims(box.container, marker, pids, init)
            for pid in victims or ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # delivered as the freezer thaws them
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_S):
                await self._api.call(
                    "POST", f"/containers/{box.container}/unpause", "unpause after a kill", ok=(404, 409)
                )
        return victims is not None


def stopped(info: dict[str, Any] | None) -> str:
    """Why a container is not running, from its ``GET /containers/{id}/json``."""
    if info is None:
        return "its container is removed"
    state = info.get("State") or {}
    code = state.get("ExitCode")
    if state.get("OOMKilled"):
        how = f"its container was killed at its memory limit (OOM, exit {code})"
    elif code == 137:  # under gVisor the daemon does not always see the OOM kill of the Sentry
        how = "its container was killed (SIGKILL, exit 137: at its memory limit, unless something else killed it)"
    else:
        how = f"its container exited ({code})"
    runtime = (info.get("HostConfig") or {}).get("Runtime")
    if runtime == "runsc":
        how += "; under gVisor (runsc) a memory or pids limit kills the whole sandbox, files and processes"
    return how
