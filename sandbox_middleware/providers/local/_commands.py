"""One command's run in a LocalProvider sandbox: its output read from pipes into bounded captures while it
runs (``run_command``), and, with ``isolation="none"``, the command as a process of ours (``run_process``);
under bwrap the sandbox's command starter runs it (``_supervisor.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread

from ..._errors import SandboxError, SandboxNotFoundError
from ..._protocol import SandboxExecResult, SandboxHandle
from .._common._output import OutputCapture, OutputPump, drain
from ._launch import LAUNCH_FAILED
from ._process import alive_ticks, group_alive, kill_group
from ._records import Box, intact

__all__ = ["run_command", "run_process"]


async def run_command(
    handle: SandboxHandle,
    box: Box,
    start: Callable[[int, int, float | None, OutputPump], Awaitable[tuple[int, bool]]],
    deadline: float | None,
    max_output: int,
) -> SandboxExecResult:
    """Run a command with ``start(stdout, stderr, deadline, output)`` (which owns and closes the two
    write ends once the command started, reads their other ends with ``output`` while it waits, and
    returns the command's return code and whether it timed out) into bounded captures."""
    out, err = OutputCapture(max_output), OutputCapture(max_output)
    out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        os.close(out_r)
        os.close(out_w)
        raise
    try:
        for fd in (out_w, err_w):
            os.set_blocking(fd, True)
            with contextlib.suppress(OSError):  # fewer wake-ups per byte when a command floods
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        try:
            output = OutputPump([(out_r, out), (err_r, err)])
        except BaseException:  # out of descriptors for its epoll, say: start() never owned the write ends
            os.close(out_w)
            os.close(err_w)
            raise
        failure: SandboxError | None = None
        try:
            code, timed_out = await start(out_w, err_w, deadline, output)
        except SandboxError as exc:  # raised below, once the sandbox's state is known
            failure, code, timed_out = exc, -signal.SIGKILL, False
        finally:
            # Whatever the command wrote before it ended is in the pipes now; a background
            # child that still holds them must not hold this call.
            output.close()
        if failure is not None and not (box.closed or box.is_expired()):
            raise failure  # its starter died: the sandbox is broken (status says so)
        drain(out_r, out, budget=64)
        drain(err_r, err, budget=64)
    finally:
        os.close(out_r)
        os.close(err_r)
    if box.closed:
        return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="closed")
    if code == LAUNCH_FAILED and box.cgroups and not await anyio.to_thread.run_sync(intact, box):
        raise SandboxNotFoundError(
            f"LocalProvider: sandbox {handle.sandbox_id!r} was removed from under this provider (closed or "
            "reaped by another process); create a new one"
        )
    if box.is_expired():
        return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="expired")
    if timed_out:
        return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="timeout")
    return SandboxExecResult(out.text(), err.text(), code)


async def run_process(
    box: Box,
    handle: SandboxHandle,
    argv: list[str],
    workdir: Path,
    env: dict[str, str],
    out_w: int,
    err_w: int,
    deadline: float | None,
    output: OutputPump,
) -> tuple[int, bool]:
    """``isolation="none"``: the command as a process of ours, in its own process group, its output
    read by ``output`` until it ends."""
    try:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise SandboxError(f"LocalProvider: cannot start a command in {handle.sandbox_id!r}: {exc}") from exc
    finally:
        os.close(out_w)
        os.close(err_w)
    if not box.cgroups:
        box.groups[process.pid] = alive_ticks()
    timed_out = False
    async with anyio.create_task_group() as readers:
        readers.start_soon(output.pump)
        try:
            with anyio.move_on_after(deadline) as scope:
                await process.wait()
            if scope.cancelled_caught:
                timed_out = True
                kill_group(process.pid)
                with anyio.CancelScope(shield=True):
                    await process.wait()
        except BaseException:
            kill_group(process.pid)
            with anyio.CancelScope(shield=True):
                await process.wait()
            raise
        finally:
            readers.cancel_scope.cancel()
    if box.cgroups or not group_alive(process.pid):
        box.groups.pop(process.pid, None)
    else:  # its leader is gone, others of it live on: from now its number is killed only with one of them
        box.groups[process.pid] = alive_ticks()
    return (process.returncode if process.returncode is not None else -signal.SIGKILL), timed_out
