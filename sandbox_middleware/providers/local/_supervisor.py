"""The provider's half of the command starter (``_starter.py``): launching it, one command's round trip, its end.

``CommandStarter.launch`` starts the starter with a host command line the caller builds (the same
launch, cgroups, uid and bwrap options a command used to get) and waits until it serves. ``run``
sends it one command with the command's own reply socket and output pipes, and waits for the
command's return code, killing it on timeout or cancellation. A starter that died, or that does not
answer a kill, is reported (``alive`` turns False and the call raises ``SandboxError``); no call
waits on it for ever.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from ..._errors import SandboxError
from .._common._output import OutputPump
from . import _starter
from ._bwrap import BASE_PATH, memfd
from ._starter import CODE, EXEC, EXIT, FAIL, INLINE_SPEC, KILL, READY, bash_environment, encode_spec, rights

__all__ = ["CommandStarter", "find_python"]

_SOURCE = Path(_starter.__file__).read_bytes()
_KILL_GRACE_S = 10.0  # a killed command's namespace is gone long before this, unless the starter is stuck
# Where an interpreter for the starter is looked for, after this process's own.
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


def find_python(visible: Sequence[str]) -> str | None:
    """A Python interpreter the sandbox can run (its real path under one of ``visible``): this
    process's own if it lies there, else the system's; None if there is none."""
    for candidate in (sys.executable, *_PYTHONS):
        if not candidate:
            continue
        real = os.path.realpath(candidate)
        if any(real == root or real.startswith(root.rstrip("/") + "/") for root in visible) and os.access(
            real, os.X_OK
        ):
            return real
    return None


# What the calibration gives bash: names that share its variable table's buckets with PWD, SHLVL,
# PATH and HOME (so the order within a bucket shows), and a HOME that is the cwd by another name.
_CALIBRATION = {
    b"SANDBOX_401": b"a", b"PATH": BASE_PATH.encode(), b"SANDBOX_3509": b"b", b"HOME": b"//",
    b"SANDBOX_1794": b"c", b"SANDBOX_2599": b"d", b"SANDBOX_3246": b"e", b"LANG": b"C.UTF-8",
}  # fmt: skip


@functools.cache
def plain_bash() -> str:
    """The bash whose plain commands a starter may start itself (``_starter.direct_command``), as
    "device:inode", or "-" for none: the one in ``BASE_PATH`` (the sandbox sees the host's ``/usr``), when
    the environment it execs ``env`` with is what ``bash_environment`` says. Run once per process, on the
    host, with a fixed command and environment (blocking: call it in a worker thread)."""
    path = _CALIBRATION[b"PATH"]
    try:
        bash = _starter._which(b"bash", path)
        program = _starter._bash_lookup(b"env", path)
        ran = subprocess.run([bash, b"-c", b"env -0"], env=_CALIBRATION, cwd="/", capture_output=True, timeout=10)
        info = os.stat(bash)
    except (OSError, subprocess.SubprocessError):
        return "-"
    expected = b"".join(
        name + b"=" + value + b"\0" for name, value in bash_environment(_CALIBRATION, b"/", program or b"").items()
    )
    if ran.returncode or ran.stderr or program is None or ran.stdout != expected:
        return "-"
    return f"{info.st_dev}:{info.st_ino}"


# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked it exits.
# Worker threads of an event loop exit when idle or when their loop ends (NeMo Gym's synchronous
# facade, asyncio.run per call), which killed live sandboxes' starters: starters are forked by this
# one thread, which waits for work for the life of the process and so dies only with it.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-starter-spawner")


class CommandStarter:
    """One sandbox's starter: its process on the host (bwrap's), the control socket, its stderr."""

    def __init__(self, process: subprocess.Popen[bytes], control: socket.socket, stderr: int, where: str) -> None:
        self._process = process
        self._control = control
        self._stderr = stderr
        self._where = where
        self._dead = False

    @classmethod
    def launch(
        cls,
        build: Callable[[list[str], list[int]], list[str]],
        python: str,
        env: dict[str, str],
        where: str,
        *,
        oom_score_adj: int,
        timeout_s: float = 30.0,
    ) -> CommandStarter:
        """Start the starter and wait until it serves (blocking: call it in a worker thread).

        ``build(command, fds)`` returns the host command line that runs ``command`` in the sandbox,
        appending the descriptors it needs to ``fds`` (closed here once the process started). Each
        command raises its ``oom_score_adj`` to ``oom_score_adj``.
        """
        fds: list[int] = []
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        process = None
        try:
            os.set_blocking(err_w, False)  # the starter never blocks on a message nobody reads
            fds.append(memfd("sandbox-starter", _SOURCE))
            script = f"/proc/self/fd/{fds[0]}"
            command = [python, "-I", "-S", "-B", script, str(theirs.fileno()), str(oom_score_adj), plain_bash()]
            argv = build(command, fds)
            process = _SPAWNER.submit(
                subprocess.Popen,
                argv,
                pass_fds=[*fds, theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err_w,
                env=env,
                start_new_session=True,
            ).result()
        except BaseException:
            control.close()
            os.close(err_r)
            raise
        finally:
            theirs.close()
            os.close(err_w)
            for fd in fds:
                os.close(fd)
        starter = cls(process, control, err_r, where)
        try:
            control.settimeout(timeout_s)
            try:
                ready = control.recv(16)
            except OSError as exc:  # socket.timeout included
                ready = f"no answer ({exc or 'timed out'})".encode()
            if ready != READY:
                why = starter._errors() or ready.decode(errors="replace")
                raise SandboxError(f"the command starter of {where} did not start: {why}")
            control.setblocking(False)
        except BaseException:
            starter.close()
            raise
        return starter

    @property
    def alive(self) -> bool:
        return not self._dead and self._process.poll() is None

    def _errors(self) -> str:
        """What the starter (or bwrap) wrote to its stderr, once it has ended or failed."""
        if self._process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=1.0)
        os.set_blocking(self._stderr, False)
        with contextlib.suppress(OSError):
            return os.read(self._stderr, 1 << 16).decode(errors="replace").strip()
        return ""

    def _gone(self, what: str) -> SandboxError:
        self._dead = True
        return SandboxError(
            f"LocalProvider: the command starter of {self._where} {what}; the sandbox can run no more "
            "commands: close it and create a new one"
        )

    async def run(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        out: int,
        err: int,
        deadline: float | None,
        output: OutputPump,
    ) -> tuple[int, bool]:
        """Run one command; its return code (``-9`` when killed) and whether ``deadline`` (seconds) ran out.

        ``out`` and ``err`` are the write ends of its output pipes, closed here once the command is
        handed over; ``output`` reads their other ends while this waits. A cancelled call kills the
        command before it ends.
        """
        try:
            if not self.alive:
                raise self._gone("is gone")
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except BaseException as exc:
            os.close(out)
            os.close(err)
            if isinstance(exc, OSError):  # out of descriptors, say
                raise SandboxError(f"LocalProvider: cannot run a command in {self._where}: {exc}") from exc
            raise
        try:
            try:
                spec = encode_spec(argv, env, cwd)
                if len(spec) <= INLINE_SPEC:  # in the message itself: no memfd to make, fill and read
                    await self._send(EXEC + spec, [theirs.fileno(), out, err])
                else:
                    held = memfd("sandbox-command", spec)
                    try:
                        await self._send(EXEC, [theirs.fileno(), out, err, held])
                    finally:
                        os.close(held)
            except OSError as exc:
                raise SandboxError(f"LocalProvider: cannot run a command in {self._where}: {exc}") from exc
            finally:
                theirs.close()
                os.close(out)
                os.close(err)
            mine.setblocking(False)
            timed_out = False
            answer: bytes | None
            try:
                with anyio.move_on_after(deadline) as scope:
                    answer = await _receive(mine, output)
                if scope.cancelled_caught:
                    timed_out = True
                    answer = await self._kill(mine, output)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._kill(mine, output)
                raise
        finally:
            mine.close()
        return self._code(answer, killed=timed_out), timed_out

    async def _send(self, message: bytes, fds: list[int]) -> None:
        ancillary = rights(fds)
        while True:
            try:
                self._control.sendmsg([message], ancillary)
                return
            except BlockingIOError:
                await anyio.wait_writable(self._control.fileno())
            except OSError as exc:
                raise self._gone(f"is gone ({exc.strerror})") from exc

    async def _kill(self, mine: socket.socket, output: OutputPump) -> bytes | None:
        """Ask for the command's death and wait (bounded) for the starter to confirm it; None if it does not."""
        with contextlib.suppress(OSError):
            mine.send(KILL)
        with anyio.move_on_after(_KILL_GRACE_S):
            return await _receive(mine, output)
        return None

    def _code(self, answer: bytes | None, *, killed: bool) -> int:
        if answer is None:
            raise self._gone(f"did not confirm a kill within {_KILL_GRACE_S:g} s")
        if answer.startswith(EXIT) and len(answer) == 1 + CODE.size:
            code: int = CODE.unpack(answer[1:])[0]
            return code
        if answer.startswith(FAIL):
            raise SandboxError(
                f"LocalProvider: cannot start a command in {self._where}: {answer[1:].decode(errors='replace')}"
            )
        if not answer and killed:  # the starter died while the command was killed: so did the command
            self._dead = True
            return -signal.SIGKILL
        raise self._gone("died" if not answer else f"answered {answer[:16]!r}")

    def kill(self) -> None:
        """SIGKILL the starter's bwrap (its session): bwrap's init, hence every process of the sandbox,
        dies with it. Safe from any thread; ``close`` still releases the rest. Once the starter has been
        waited for, nothing is signalled: its number may be another program's session by then."""
        self._dead = True
        if self._process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)

    def close(self) -> None:
        """End the starter and every process of its sandbox (blocking: call it in a worker thread)."""
        self.kill()
        self._process.wait()
        if self._stderr >= 0:  # a close that failed further on is tried again: this part only once
            self._control.close()
            os.close(self._stderr)
            self._stderr = -1


async def _receive(sock: socket.socket, output: OutputPump) -> bytes:
    """The next message on ``sock`` (``output`` read meanwhile); ``b""`` when the other end is gone."""
    while True:
        await output.wait_readable(sock.fileno())
        try:
            return sock.recv(64)
        except BlockingIOError:
            continue
        except OSError:
            return b""
