"""Attacks as a hostile command would make them, each asserted on the host or from a second command."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import DockerProvider, SandboxError, SandboxPathError, SandboxTransferLimitError
from sandbox_middleware.providers.docker._exec import cgroup_pids

from ._support import PYTHON, RUNTIME, cannot_hold, engine, spec

pytestmark = pytest.mark.anyio
_SENTRY_PIDS = (
    "the pids limit counts the threads of gVisor's Sentry, not the sandbox's processes: 32 cannot start one, "
    "and a fork bomb kills the whole sandbox (test_runtimes.py: test_under_gvisor_a_limit_kills_...)"
)


async def test_no_capability_no_new_privileges(provider: DockerProvider) -> None:
    """No capability in any set, and no_new_privs, asked of the kernel (prctl PR_GET_NO_NEW_PRIVS: gVisor's
    /proc/self/status has no NoNewPrivs line)."""
    handle = await provider.create(spec())
    status = (await provider.exec(handle, "grep -E '^(CapEff|CapBnd|CapPrm)' /proc/self/status")).stdout
    assert status.split() == ["CapPrm:", "0" * 16, "CapEff:", "0" * 16, "CapBnd:", "0" * 16]
    assert (await provider.exec(handle, "mknod /tmp/dev c 1 3")).return_code != 0
    assert (await provider.exec(handle, "chown 0 /tmp")).return_code != 0
    python = await provider.create(spec(PYTHON))
    no_new_privs = "import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))"
    assert (await provider.exec(python, f'python3 -c "{no_new_privs}"')).stdout == "1\n"
    await provider.close(handle)
    await provider.close(python)


async def test_the_root_filesystem_is_read_only(provider: DockerProvider) -> None:
    handle = await provider.create(spec())
    # gVisor checks the permission (the sandbox's uid owns none of these) before the read-only mount
    refused = "Read-only file system|Permission denied" if RUNTIME == "runsc" else "Read-only file system"
    for target in ("/etc/passwd", "/bin/evil", "/newfile"):
        result = await provider.exec(handle, f"echo pwned > {target}")
        assert result.return_code != 0 and re.search(refused, result.stderr), (target, result)
    # a directory of uid 1000: gVisor checks the permission (the sandbox's uid is not its owner) before the mount
    result = await provider.exec(handle, "echo pwned > /home/sandbox/x")
    assert result.return_code != 0 and re.search("Read-only file system|Permission denied", result.stderr), result
    assert "root:x:0:0" in (await provider.exec(handle, "cat /etc/passwd")).stdout
    await provider.close(handle)


async def test_no_network(provider: DockerProvider) -> None:
    """Only a loopback interface; nothing outside is reachable (the daemon's bridge gateway neither)."""
    handle = await provider.create(spec(PYTHON))
    links = (await provider.exec(handle, "cat /proc/net/dev")).stdout
    assert [line.split(":")[0].strip() for line in links.splitlines()[2:]] == ["lo"]
    probe = "import socket; socket.create_connection(('172.17.0.1', 2375), timeout=2)"
    result = await provider.exec(handle, f'python3 -c "{probe}"')
    assert result.return_code != 0 and re.search("unreachable|no route to host", result.stderr.lower()), result
    await provider.close(handle)


async def test_pids_limit_holds(make: Callable[..., DockerProvider]) -> None:
    """A fork bomb stops at the limit; a command holding every pid is still killed at its timeout (its
    kill needs no fork), and the container can run commands again."""
    cannot_hold("runsc", _SENTRY_PIDS)
    provider = make(pids=32)
    handle = await provider.create(spec())
    bomb = await provider.exec(handle, "for i in $(seq 100); do sleep 30 & done; wait")
    assert "can't fork" in bomb.stderr
    assert 20 < len(_processes(handle.sandbox_id)) <= 32
    python = await provider.create(spec(PYTHON))
    hog = (
        "import os, time\nwhile True:\n    try:\n        os.fork() or time.sleep(1000)\n"
        "    except OSError:\n        time.sleep(0.01)"
    )
    held = await provider.exec(python, f"python3 -c '{hog}'", timeout_s=3)
    assert held.error_type == "timeout"
    with anyio.fail_after(10):  # the killed processes' pids come back once init has reaped them
        while (count := await provider.exec(python, "ls -d /proc/[0-9]* | wc -l")).return_code != 0:
            await anyio.sleep(0.2)
    assert int(count.stdout) < 10, count
    await provider.close(handle)
    await provider.close(python)


async def test_memory_limit_holds(make: Callable[..., DockerProvider]) -> None:
    """A command that allocates past memory_mib is killed (137), the container lives on."""
    cannot_hold("runsc", "the whole sandbox is killed (test_runtimes.py: test_under_gvisor_a_limit_kills_...)")
    provider = make(memory_mib=64)
    handle = await provider.create(spec(PYTHON))
    result = await provider.exec(handle, "python3 -c 'x = bytearray(512 << 20); print(len(x))'")
    assert result.return_code == 137 and result.stdout == ""
    assert (await provider.exec(handle, "echo alive")).stdout == "alive\n"
    await provider.close(handle)


async def test_disk_is_bounded_by_the_work_directory(make: Callable[..., DockerProvider]) -> None:
    provider = make(disk_gib=0.01, tmp_mib=4)
    handle = await provider.create(spec())
    work = await provider.exec(handle, "dd if=/dev/zero of=big bs=1M count=50")
    assert work.return_code != 0 and "No space left" in work.stderr
    tmp = await provider.exec(handle, "dd if=/dev/zero of=/tmp/big bs=1M count=50")
    assert tmp.return_code != 0 and "No space left" in tmp.stderr
    await provider.close(handle)


async def test_a_runaway_command_is_killed_at_its_timeout(provider: DockerProvider) -> None:
    """Its children, its grandchildren and one that cleared its environment are gone; a server
    started by an earlier command is not."""
    handle = await provider.create(spec())
    await provider.exec(handle, "sleep 1000 > /dev/null 2>&1 &")
    runaway = "sleep 2001 & (sleep 2002 & wait) & env -i sleep 2003 & while :; do :; done"
    with anyio.fail_after(30):
        result = await provider.exec(handle, runaway, timeout_s=1)
    assert result.error_type == "timeout" and result.return_code != 0
    ps = (await provider.exec(handle, "ps -o args")).stdout
    assert "sleep 1000" in ps
    assert not any(f"sleep {n}" in ps for n in (2001, 2002, 2003)), ps
    assert "do :; done" not in ps
    await provider.close(handle)


async def test_output_floods_stay_bounded(make: Callable[..., DockerProvider]) -> None:
    provider = make(max_output_bytes=4096)
    handle = await provider.create(spec())
    result = await provider.exec(
        handle, "echo first; head -c 50000000 /dev/zero | tr '\\0' x; echo; echo last; head -c 1000000 /dev/zero >&2"
    )
    assert result.stdout.startswith("first\n") and result.stdout.endswith("last\n")
    assert "bytes truncated" in result.stdout and len(result.stdout) < 4096 + 200
    assert "bytes truncated" in result.stderr
    await provider.close(handle)


async def test_the_environment_is_in_no_host_process_argv(provider: DockerProvider) -> None:
    """spec.env and the call's env travel in API bodies: no host process's command line holds them."""
    secret, call_secret = "s3cr3t-" + os.urandom(8).hex(), "c4ll-" + os.urandom(8).hex()
    handle = await provider.create(spec(env={"TOKEN": secret}))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(functools.partial(provider.exec, handle, "sleep 3", env={"CALL": call_secret}))
        await anyio.sleep(1.5)
        leaked = []
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if secret.encode() in argv or call_secret.encode() in argv:
                leaked.append(argv)
        assert leaked == []
    assert (await provider.exec(handle, "echo $TOKEN")).stdout == f"{secret}\n"
    await provider.close(handle)


async def test_transfers_refuse_symlinks_special_files_and_big_files(
    make: Callable[..., DockerProvider], tmp_path: Path
) -> None:
    provider = make(max_transfer_bytes=1000)
    handle = await provider.create(spec())
    await provider.exec(handle, "ln -s /etc/passwd link; mkfifo fifo; mkdir dir; head -c 2000 /dev/zero > big")
    with pytest.raises(SandboxPathError, match="symlink"):
        await provider.download_file(handle, "link", tmp_path / "x")
    for special in ("fifo", "dir"):
        with pytest.raises(SandboxError, match="not a file"):
            await provider.download_file(handle, special, tmp_path / "x")
    with pytest.raises(SandboxTransferLimitError, match="2000 bytes, over max_transfer_bytes=1000"):
        await provider.download_file(handle, "big", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    # a symlink in a parent component is refused too: the daemon would follow it
    await provider.exec(handle, "ln -s /etc etc; mkdir -p real && echo ok > real/file && ln -s real alias")
    for through in ("etc/passwd", "alias/file"):
        with pytest.raises(SandboxPathError, match="not a directory"):
            await provider.download_file(handle, through, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    await provider.download_file(handle, "real/file", tmp_path / "x")
    assert (tmp_path / "x").read_text() == "ok\n"
    # an upload through a planted symlink is refused; the link's target is never written
    await provider.exec(handle, "ln -s /etc planted")
    (tmp_path / "in").write_text("x")
    with pytest.raises(SandboxPathError, match="'planted/passwd'"):
        await provider.upload_file(handle, tmp_path / "in", "planted/passwd")
    assert "root:x" in (await provider.exec(handle, "cat /etc/passwd")).stdout
    await provider.close(handle)


async def test_ttl_is_enforced_whatever_the_entrypoint(provider: DockerProvider) -> None:
    """A container with its own entrypoint is removed at its deadline by the watchdog process; a
    command running into the TTL returns error_type="expired"."""
    handle = await provider.create(spec(entrypoint=["sleep", "1000"], ttl_s=5))  # past a loaded gVisor create
    result = await provider.exec(handle, "sleep 30")
    assert result.error_type == "expired"
    with engine() as client:
        with anyio.fail_after(10):
            while client.get(f"/containers/{handle.sandbox_id}/json").status_code != 404:
                await anyio.sleep(0.2)
    await provider.close(handle)


async def test_output_to_the_main_process_fills_no_host_disk(provider: DockerProvider) -> None:
    """50 MB written to PID 1's stdout and stderr (writable by the sandbox's user) lands in no log
    file on the host: the container has no log driver; /dev/shm is a small tmpfs."""
    handle = await provider.create(spec(entrypoint=["sh", "-c", "head -c 5000000 /dev/zero; sleep 1000"]))
    flood = "head -c 50000000 /dev/zero > /proc/1/fd/1; head -c 50000000 /dev/zero > /proc/1/fd/2; echo done"
    assert (await provider.exec(handle, flood)).stdout == "done\n"
    with engine() as client:
        info = client.get(f"/containers/{handle.sandbox_id}/json").json()
    assert info["HostConfig"]["LogConfig"]["Type"] == "none"
    log = info.get("LogPath") or ""
    assert log == "" or not os.path.exists(log) or os.path.getsize(log) < 4096
    shm = await provider.exec(handle, "dd if=/dev/zero of=/dev/shm/big bs=1M count=64")
    assert shm.return_code != 0 and "No space left" in shm.stderr
    await provider.close(handle)


def _processes(handle_id: str) -> list[str]:
    """The command lines of a container's processes, seen from the host (its cgroup: Podman's top forks into
    the container, which a full pids limit refuses)."""
    with engine() as client:
        init = client.get(f"/containers/{handle_id}/json").json()["State"]["Pid"]
    lines = []
    for pid in cgroup_pids(init) or []:
        with contextlib.suppress(OSError):
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
    return sorted(lines)


async def _at_rest(handle_id: str) -> list[str]:
    """The processes of a new container once its keep-alive loop has started its sleep (right after
    the create, the loop's child may still be a forked shell, which later lists as ``sleep 86400``)."""
    with anyio.move_on_after(10):
        while "sleep 86400" not in _processes(handle_id):
            await anyio.sleep(0.05)
    return _processes(handle_id)


async def _settled(handle_id: str, expected: list[str]) -> list[str]:
    """The container's processes once the killed ones are reaped (a few seconds at most)."""
    with anyio.move_on_after(5):
        while _processes(handle_id) != expected:
            await anyio.sleep(0.2)
    return _processes(handle_id)


async def test_a_command_holding_every_pid_leaves_nothing_after_its_timeout(
    make: Callable[..., DockerProvider],
) -> None:
    """A session of its own forking sleeps until the pids limit is full: an in-container kill could
    not fork a thing; the kill from the host leaves nothing of the command."""
    cannot_hold("runsc", _SENTRY_PIDS)
    provider = make(pids=64)
    handle = await provider.create(spec())
    before = await _at_rest(handle.sandbox_id)  # init and the keep-alive loop
    bomb = "setsid sh -c 'while :; do sleep 1000 & done' >/dev/null 2>&1 & sleep 30"
    with anyio.fail_after(30):
        result = await provider.exec(handle, bomb, timeout_s=3)
    assert result.error_type == "timeout"
    assert await _settled(handle.sandbox_id, before) == before
    assert (await provider.exec(handle, "echo alive")).stdout == "alive\n"
    await provider.close(handle)


async def test_a_watcher_killing_the_kill_leaves_nothing_after_the_timeout(provider: DockerProvider) -> None:
    """A watcher in its own session SIGKILLs every process that looks like the provider's kill; the
    container is frozen while the host kills, so it never gets the chance."""
    cannot_hold(
        "runsc", "no process of a gVisor sandbox is a host process: the kill runs inside, where a watcher can kill it"
    )
    handle = await provider.create(spec())
    before = await _at_rest(handle.sandbox_id)
    watcher = (
        'setsid sh -c \'while :; do for d in /proc/[0-9]*; do grep -q "for roun[d]" $d/cmdline 2>/dev/null '
        "&& kill -9 ${d#/proc/}; done; done' >/dev/null 2>&1 & sleep 1001"
    )
    with anyio.fail_after(30):
        result = await provider.exec(handle, watcher, timeout_s=3)
    assert result.error_type == "timeout"
    assert await _settled(handle.sandbox_id, before) == before
    await provider.close(handle)
