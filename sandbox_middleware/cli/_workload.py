"""The ``run`` command's workload: rollout-shaped sessions pulled by a fixed pool of workers.

With ``fork=N`` each session prepares its state once (its first command, in its own sandbox), forks
it into N sandboxes (``Sandbox.fork``: one snapshot, N creates from it) and runs the rest of its
commands in each fork; each fork's result must hold the prepared step and its own steps only.

SIGINT and SIGTERM stop it: no new session starts, sessions in flight are cancelled, and every
sandbox they hold is closed (shielded from cancellation, bounded in time) before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from .._errors import CommandFailedError, SandboxSnapshotError
from .._protocol import SandboxProvider, SandboxSpec
from .._sandbox import Sandbox
from ..testing import FAULT_STREAM

logger = logging.getLogger("sandbox_middleware")

__all__ = ["CLEANUP_TIMEOUT_S", "CLOSE_TIMEOUT_S", "RunState", "workload"]

CLOSE_TIMEOUT_S = 30.0
"""How long one session waits for its sandbox to close."""
CLEANUP_TIMEOUT_S = 60.0
"""How long the cleanup pass at the end (or after a signal) keeps trying to close what is left."""
CLEANUP_ROUNDS = 3


@dataclass
class RunState:
    """What the workload did so far; the progress bar and the table read it."""

    sessions: int
    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    """Sessions in flight when a signal arrived."""
    started: int = 0
    """Sandboxes started: one per session, plus its forks."""
    forks: int = 0
    """Sandboxes made as forks of a session's prepared sandbox (``fork=N``), counted in ``started`` too."""
    handed_out: int = 0
    interrupted_by: signal.Signals | None = None
    leftovers: list[Sandbox] = field(default_factory=list)
    """Sandboxes whose session could not close them; the cleanup pass tries again."""
    session_errors: dict[str, int] = field(default_factory=dict)
    held_changes: list[tuple[float, int]] | None = None
    """When a list: (wall time, +1 / -1) each time a session's sandbox (or a fork of it) started or
    stopped, so that a cluster's peak can be computed from every worker's changes merged in time order
    (Ray workers only: it grows by two entries per sandbox)."""

    @property
    def done(self) -> int:
        return self.ok + self.failed + self.cancelled

    @property
    def not_run(self) -> int:
        return self.sessions - self.handed_out


async def workload(
    provider: SandboxProvider,
    run: RunState,
    *,
    concurrency: int,
    commands: int,
    think_s: float = 0.0,
    image: str | None = None,
    fork: int | None = None,
    background: Callable[[RunState], Coroutine[Any, Any, None]] | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = True,
) -> None:
    """Run ``run.sessions`` sessions, ``concurrency`` at a time, then close what is left and the provider.

    Each session's sandbox runs ``image`` (``spec.image``) and waits ``think_s`` after each command
    (the model writing its next turn). With ``fork=N`` (a provider with ``SupportsSandboxSnapshot``,
    ``commands`` at least 1) its first command prepares the state and the rest run in each of ``N``
    forks of it.
    ``background`` (the progress bar) runs alongside until the end; ``finish`` (looking for
    orphans) runs after the cleanup pass, before the provider is closed. ``handle_signals=False``
    leaves SIGINT and SIGTERM to the host process (a Ray worker).
    """
    with contextlib.ExitStack() as receiving:  # none without handle_signals (trio refuses a receiver of none)
        async with anyio.create_task_group() as watchers:
            work = anyio.CancelScope()
            if handle_signals:
                signals = receiving.enter_context(anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM))
                watchers.start_soon(_stop_on_signal, signals, run, work)
            if background is not None:
                watchers.start_soon(background, run)
            try:
                with tempfile.TemporaryDirectory(prefix="sandbox-middleware-run-") as tmp:
                    with work:
                        await _pool(provider, run, Path(tmp), concurrency, commands, think_s, image, fork)
                    with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                        await _cleanup(run)
                if finish is not None:
                    with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                        await finish()
            finally:
                with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                    await provider.aclose()
                watchers.cancel_scope.cancel()


async def _stop_on_signal(signals: AsyncIterator[signal.Signals], run: RunState, work: anyio.CancelScope) -> None:
    async for number in signals:
        if run.interrupted_by is None:
            run.interrupted_by = signal.Signals(number)
            print(
                f"\n{run.interrupted_by.name}: starting no new sessions; creates in flight finish (so their "
                "sandboxes are not orphaned), then every sandbox held is closed",
                file=sys.stderr,
            )
            work.cancel()
        else:
            print(f"{signal.Signals(number).name} again: still closing sandboxes", file=sys.stderr)


async def _pool(
    provider: SandboxProvider,
    run: RunState,
    workdir: Path,
    concurrency: int,
    commands: int,
    think_s: float,
    image: str | None,
    fork: int | None,
) -> None:
    """``concurrency`` workers each take the next session until none is left: memory does not grow with it."""
    source = workdir / "input.txt"
    source.write_text("rollout input\n" * 64)

    async def worker(result: Path) -> None:
        while run.handed_out < run.sessions:
            FAULT_STREAM.set(f"session {run.handed_out}")  # its faults: by the seed and its number alone
            run.handed_out += 1
            await _session(provider, SandboxSpec(image=image), commands, think_s, source, result, run, fork)

    async with anyio.create_task_group() as tg:
        for number in range(min(concurrency, run.sessions)):
            tg.start_soon(worker, workdir / f"result-{number}.txt")  # each worker's result overwrites its last


async def _session(
    provider: SandboxProvider,
    spec: SandboxSpec,
    commands: int,
    think_s: float,
    source: Path,
    result: Path,
    run: RunState,
    fork: int | None,
) -> None:
    sandbox = Sandbox(provider, spec, local_files={"input.txt": source}, close_timeout_s=CLOSE_TIMEOUT_S)
    forks: list[Sandbox] = []
    try:
        await sandbox.start()
        _started(run, 1)
        await _steps(sandbox, range(commands if fork is None else 1), think_s)  # forks: prepares their state
        if fork is None and commands:
            await sandbox.download("result.txt", result)
        if fork is not None:
            forks = await sandbox.fork(fork)  # on failure: the forks made are closed, the snapshot deleted
            run.forks += len(forks)
            _started(run, len(forks))
        await _stop(sandbox, run)  # with forks, its state lives on in them
        await _run_forks(forks, range(1, commands), think_s, result, run)
        run.ok += 1
    except anyio.get_cancelled_exc_class():
        run.cancelled += 1
        raise
    except Exception as exc:
        run.failed += 1
        key = type(exc).__name__
        if key not in run.session_errors:  # each kind's message once: the table counts them by class
            logger.error("a session failed: %s: %s", key, exc)
        run.session_errors[key] = run.session_errors.get(key, 0) + 1
    finally:
        # shielded and bounded: runs even while the session is cancelled
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for each in (sandbox, *forks):
                    group.start_soon(_release, each, run)


def _started(run: RunState, count: int) -> None:
    run.started += count
    if run.held_changes is not None:
        run.held_changes.extend([(time.time(), 1)] * count)


async def _steps(sandbox: Sandbox, steps: range, think_s: float) -> None:
    """The workload's commands ``steps``: each appends its number and the input's size to result.txt."""
    for step in steps:
        done = await sandbox.exec(f"echo step {step} >> result.txt && wc -c < input.txt >> result.txt")
        if done.return_code != 0:
            raise CommandFailedError(f"step {step} exited {done.return_code}: {done.stderr}")
        if think_s:
            await anyio.sleep(think_s)


async def _run_forks(forks: list[Sandbox], steps: range, think_s: float, result: Path, run: RunState) -> None:
    """The rest of the session (``steps``) in every fork at once, each fork stopped once its result
    checks out; the first fork's error is the session's (its forks are released by the session)."""
    errors: list[Exception] = []
    session = FAULT_STREAM.get()

    async def one(number: int, fork: Sandbox) -> None:
        FAULT_STREAM.set(f"{session} fork {number}")  # this task's own context: its faults its own
        downloaded = result.with_name(f"{result.stem}-fork-{number}{result.suffix}")
        try:
            await _steps(fork, steps, think_s)
            await fork.download("result.txt", downloaded)
            wrote = [line for line in downloaded.read_text().splitlines() if line.startswith("step ")]
            wanted = [f"step {step}" for step in (0, *steps)]
            if wrote != wanted:
                raise SandboxSnapshotError(
                    f"fork {number} of {session or 'a session'}: its result.txt has {wrote}, not {wanted} (the "
                    "prepared step, then its own): the fork did not start from its snapshot, or shares files with "
                    "another sandbox"
                )
            await _stop(fork, run)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        for number, fork in enumerate(forks):
            group.start_soon(one, number, fork)
    if errors:
        raise errors[0]


async def _stop(sandbox: Sandbox, run: RunState) -> None:
    """Stop a started sandbox (shielded, bounded) and note its release; raises what stop raised (a
    no-op when it is not started)."""
    if not sandbox.started:
        return
    await sandbox.stop()
    if run.held_changes is not None:
        run.held_changes.append((time.time(), -1))


async def _release(sandbox: Sandbox, run: RunState) -> None:
    """Stop ``sandbox`` if it is still started; one that will not stop is left to the cleanup pass."""
    try:
        await _stop(sandbox, run)
    except Exception:  # counted by the metrics layer; the cleanup pass tries again
        run.leftovers.append(sandbox)


async def _cleanup(run: RunState) -> None:
    """Stop what a session could not, a few rounds, as an operator's cleanup pass would."""
    for _ in range(CLEANUP_ROUNDS):
        pending = [sandbox for sandbox in run.leftovers if sandbox.started]
        if not pending:
            return
        async with anyio.create_task_group() as tg:
            for sandbox in pending:
                tg.start_soon(_stop_quietly, sandbox, run)


async def _stop_quietly(sandbox: Sandbox, run: RunState) -> None:
    with contextlib.suppress(Exception):  # counted by the metrics layer; retried in the next round
        await _stop(sandbox, run)
