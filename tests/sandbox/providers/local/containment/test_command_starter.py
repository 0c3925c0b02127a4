"""Attacks on the command starter (``_starter.py``): the one process per bwrap sandbox that starts its commands.

A command must not see, signal or talk to the starter, must not answer for another command, must
not outlive its own end or its kill; a dead starter is reported, never waited on.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import LocalProvider, SandboxError, SandboxSpec, SandboxStatus

from ._support import as_root, bwrap_only

pytestmark = [pytest.mark.anyio, bwrap_only]


def _host_pids(marker: str) -> list[int]:
    """Live processes on the host whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (
                marker.encode() in (entry / "cmdline").read_bytes()
                and "Z" not in (entry / "stat").read_text().split(")")[-1].split()[:1]
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_a_command_sees_only_its_own_processes_and_descriptors(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """Its PID namespace holds its init (1) and itself: no starter, no other command; it holds only 0-2."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    async with anyio.create_task_group() as group:
        group.start_soon(local.exec, handle, "sleep 3")
        await anyio.sleep(0.5)
        result = await local.exec(handle, "echo $$; cat /proc/[0-9]*/comm | tr '\\n' ' '; echo; ls /proc/self/fd")
        group.cancel_scope.cancel()
    pid, names, fds = (result.stdout or "").split("\n", 2)
    assert pid == "2"
    assert "sleep" not in names.split()  # the other command's
    assert names.split().count("python3") + names.split().count("python3.11") <= 1  # its own init only
    assert fds.split() == ["0", "1", "2", "3"]  # 3: ls's own directory


async def test_a_command_cannot_harm_the_starter_or_other_commands(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """``kill -9 -1``, ``kill -STOP -1`` and signals to its init reach nothing outside the command:
    a concurrent command finishes with its own output and code, and later commands run."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    results = {}

    async def victim() -> None:
        results["victim"] = await local.exec(handle, "sleep 1; echo mine; exit 7")

    async with anyio.create_task_group() as group:
        group.start_soon(victim)
        await anyio.sleep(0.2)
        hostile = await local.exec(
            handle, "kill -STOP -1; kill -9 1; kill -STOP 1; for p in $(seq 1 300); do kill -9 $p; done; echo tried"
        )
    assert results["victim"].stdout == "mine\n" and results["victim"].return_code == 7
    assert hostile.return_code in (137, -signal.SIGKILL)  # it killed itself, nothing else
    later = await local.exec(handle, "echo alive")
    assert later.stdout == "alive\n" and await local.status(handle) == SandboxStatus.RUNNING


async def test_nothing_outlives_its_command_or_its_kill(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """A ``setsid`` background child dies when its command ends, and when its command times out."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    ended, killed = f"{uuid.uuid4().int % 10**6 + 10**6}", f"{uuid.uuid4().int % 10**6 + 2 * 10**6}"
    result = await local.exec(handle, f"setsid sleep {ended} > /dev/null 2>&1 & echo started")
    assert result.stdout == "started\n"
    timed_out = await local.exec(handle, f"setsid sleep {killed} > /dev/null 2>&1 & sleep 30", timeout_s=0.5)
    assert timed_out.error_type == "timeout"
    with anyio.fail_after(10):
        while _host_pids(f"sleep\0{ended}") or _host_pids(f"sleep\0{killed}"):
            await anyio.sleep(0.05)


async def test_a_cancelled_exec_kills_its_command(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    marker = f"{uuid.uuid4().int % 10**6 + 3 * 10**6}"
    with anyio.move_on_after(1):
        await local.exec(handle, f"sleep {marker}")
    with anyio.fail_after(10):
        while _host_pids(f"sleep\0{marker}"):
            await anyio.sleep(0.05)
    assert (await local.exec(handle, "echo next")).stdout == "next\n"


async def test_concurrent_commands_get_their_own_results(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    results: dict[int, tuple[str | None, str | None, int]] = {}

    async def run(n: int) -> None:
        result = await local.exec(handle, f"echo out{n}; echo err{n} >&2; exit {n}", env={"N": str(n)})
        results[n] = (result.stdout, result.stderr, result.return_code)

    async with anyio.create_task_group() as group:
        for n in range(8):
            group.start_soon(run, n)
    assert results == {n: (f"out{n}\n", f"err{n}\n", n) for n in range(8)}


async def test_a_command_too_large_for_its_message_runs_alike(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """A command, environment and cwd sent inside the starter's message and ones too large for it (sent in
    a memfd) reach the command whole, byte for byte."""
    from sandbox_middleware.providers.local._starter import INLINE_SPEC

    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    await local.exec(handle, "mkdir -p 'sub dir'")
    for size in (10, INLINE_SPEC // 4, INLINE_SPEC, 4 * INLINE_SPEC):  # command and BIG: twice the size
        text = ("x" * 63 + "\n") * (size // 64 + 1)
        env = {"BIG": text, "SMALL": "é=1"}
        result = await local.exec(
            handle, f': {text[:size]!r}; printf %s "$BIG"; echo "$SMALL" "$PWD"', env=env, cwd="sub dir"
        )
        assert result.return_code == 0, (size, result.stderr)
        assert result.stdout.startswith(text) and result.stdout.endswith("é=1 /workspace/sub dir\n"), size


@as_root
async def test_a_dead_starter_is_reported_not_waited_on(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """The starter killed from outside (as an OOM kill would): a running command ends, later calls
    raise SandboxError at once, status says error, and close still removes everything."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    starters = [
        pid
        for pid in _host_pids("/proc/self/fd/")
        if handle.sandbox_id.encode() in _proc(pid, "cgroup") and b"-I\0-S" in _proc(pid, "cmdline")
    ]
    starter = next(
        pid
        for pid in starters
        if not _proc(pid, "cmdline").startswith(b"/bin/sh") and b"bwrap" not in _proc(pid, "cmdline")
    )

    async def kill_soon() -> None:
        await anyio.sleep(0.5)
        os.kill(starter, signal.SIGKILL)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(kill_soon)
            with pytest.raises(SandboxError, match="starter"):
                await local.exec(handle, "sleep 30")
        with pytest.raises(SandboxError, match=r"command starter .* gone"):
            await local.exec(handle, "true")
    assert await local.status(handle) == SandboxStatus.ERROR
    await local.close(handle)
    assert not Path(handle.raw["root"]).exists()


def _proc(pid: int, name: str) -> bytes:
    """``/proc/<pid>/<name>``, empty for a process gone since it was listed (another test's, ending)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


async def test_a_closed_starter_is_never_signalled_again(
    make: Callable[..., LocalProvider], sandbox_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its sandbox is closed the starter has been waited for, and its number is free for any new
    session (a Ray raylet was killed so): a later kill of it, as a retried close makes, signals nothing."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    starter = local._boxes[handle.sandbox_id].starter
    assert starter is not None
    await local.close(handle)
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, number: signalled.append((pgid, number)))
    starter.kill()
    assert signalled == []
