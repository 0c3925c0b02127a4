"""Processes that outlive their welcome: TTLs, cancelled commands, close during exec, aclose, and cleanup."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import (
    LocalProvider,
    SandboxError,
    SandboxExpiredError,
    SandboxNotFoundError,
    SandboxSpec,
    SandboxStatus,
)
from tests.leftovers import sandbox_dirs

from ._support import as_root

pytestmark = pytest.mark.anyio


async def test_ttl_ends_a_sandbox(
    make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path
) -> None:
    """After ttl_s the sandbox's processes are killed, status says stopped and commands are refused."""
    local = make(isolation=isolation, base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(ttl_s=1))
    with anyio.fail_after(30):
        result = await local.exec(handle, "sleep 30")
    assert result.error_type == "expired"
    assert await local.status(handle) == SandboxStatus.STOPPED
    with pytest.raises(SandboxExpiredError, match="ttl_s ran out"):
        await local.exec(handle, "true")
    await local.close(handle)
    assert not Path(handle.raw["root"]).exists()


async def test_ttl_kills_background_processes_without_calls(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """Without isolation a background process outlives its command; the TTL still kills it, unasked."""
    local = make(isolation="none", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(ttl_s=1))
    started = await local.exec(handle, "setsid sleep 60 > /dev/null 2>&1 & echo $!")
    pid = int(started.stdout)
    with anyio.fail_after(20):
        while _alive(pid):
            await anyio.sleep(0.1)
    await local.close(handle)


async def test_a_huge_ttl_does_not_stop_other_ttls(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """A TTL near the maximum neither breaks the watchdog nor delays another sandbox's shorter TTL."""
    local = make(isolation="none", base_dir=sandbox_base)
    await local.create(SandboxSpec(ttl_s=29 * 24 * 3600))
    short = await local.create(SandboxSpec(ttl_s=1))
    pid = int((await local.exec(short, "setsid sleep 60 > /dev/null 2>&1 & echo $!")).stdout)
    with anyio.fail_after(20):
        while _alive(pid):
            await anyio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@as_root
async def test_close_kills_escaped_sessions(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """A command that leaves its process group (setsid) still dies at close: the cgroup holds it."""
    local = make(isolation="none", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    pid = int((await local.exec(handle, "setsid sleep 60 > /dev/null 2>&1 & echo $!")).stdout)
    assert _alive(pid)
    await local.close(handle)
    with anyio.fail_after(10):
        while _alive(pid):
            await anyio.sleep(0.05)


async def test_cancelled_exec_leaves_no_process_group_to_signal_later(provider: LocalProvider) -> None:
    """A cancelled command is killed and forgotten: nothing a later close could signal by a reused pid."""
    handle = await provider.create(SandboxSpec())
    for _ in range(5):
        with anyio.move_on_after(0.2):
            await provider.exec(handle, "sleep 30")
    assert provider._boxes[handle.sandbox_id].groups == {}


async def test_close_during_exec_says_closed(provider: LocalProvider) -> None:
    """A command running when its sandbox is closed returns error_type="closed", not "expired"."""
    handle = await provider.create(SandboxSpec())
    results = []

    async def run() -> None:
        results.append(await provider.exec(handle, "sleep 30"))

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await anyio.sleep(0.5)
        await provider.close(handle)
    assert results[0].error_type == "closed"


async def test_exec_after_close_is_not_found(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    with pytest.raises(SandboxNotFoundError):
        await provider.exec(handle, "true")


async def test_aclose_closes_every_sandbox_even_when_one_fails(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """A very deep tree may defeat removal (RecursionError before Python 3.13): it is reported as a
    SandboxError, and aclose still closes every other sandbox."""
    local = make(isolation="none", base_dir=sandbox_base, disk_gib=None)
    deep, other = await local.create(SandboxSpec()), await local.create(SandboxSpec())
    await local.exec(deep, "for i in $(seq 1500); do mkdir d && cd d || break; done")
    try:
        await local.aclose()
    except SandboxError as exc:
        assert deep.sandbox_id in str(exc)
    assert not Path(other.raw["root"]).exists()
    if Path(deep.raw["root"]).exists():  # left for the test to clean up, as the error said
        await anyio.run_process(["rm", "-rf", str(Path(deep.raw["root"]).parent)])


@as_root
async def test_aclose_keeps_the_shared_cgroup_parent(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """One provider's aclose never breaks another's next create."""
    first, second = make(isolation="none", base_dir=sandbox_base), make(isolation="none", base_dir=sandbox_base)
    await second.create(SandboxSpec())
    await second.aclose()
    handle = await first.create(SandboxSpec())
    assert (await first.exec(handle, "echo ok")).stdout == "ok\n"


async def test_close_reports_what_it_could_not_delete(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """Files close cannot remove are reported, not ignored; a later close retries."""
    local = make(base_dir=sandbox_base, disk_gib=None)
    handle = await local.create(SandboxSpec())
    locked = Path(handle.raw["root"]) / "locked"
    locked.mkdir()
    (locked / "f").write_text("x")
    await anyio.run_process(["chattr", "+i", str(locked / "f")], check=False)
    if not await _immutable(locked / "f"):
        pytest.skip("this filesystem does not support the immutable attribute")
    try:
        with pytest.raises(SandboxError, match="could not be removed"):
            await local.close(handle)
        assert await local.status(handle) == SandboxStatus.ERROR
    finally:
        await anyio.run_process(["chattr", "-i", str(locked / "f")])
    await local.close(handle)
    assert not Path(handle.raw["root"]).exists()


async def _immutable(path: Path) -> bool:
    out = (await anyio.run_process(["lsattr", str(path)], check=False)).stdout.decode()
    return "i" in out.split()[0] if out else False


@as_root
async def test_failed_create_leaves_nothing_behind(
    make: Callable[..., LocalProvider],
    provider: LocalProvider,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_base: Path,
) -> None:
    """A create that fails half-way (its disk too small for its own files) removes what it made."""
    known = uuid.uuid4()  # this run's own: a fixed one collided in the machine's cgroup tree across xdist workers
    monkeypatch.setattr("sandbox_middleware.providers.local._provider.uuid.uuid4", lambda: known)
    tiny = make(isolation=provider.isolation, base_dir=sandbox_base, disk_gib=1e-9)
    with pytest.raises(SandboxError, match="cannot create a sandbox"):
        await tiny.create(SandboxSpec())
    assert sandbox_dirs(sandbox_base) == []
    leftovers = list(Path("/sys/fs/cgroup").glob(f"**/sandbox-middleware/local-{known.hex[:12]}"))
    assert leftovers == []


_DEEP = (
    'python3 -c \'import os\nfor _ in range(3000):\n    os.mkdir("d")\n    os.chdir("d")\nopen("leaf", "w").close()\''
)


async def test_close_removes_a_tree_thousands_deep(
    make: Callable[..., LocalProvider], isolation: str, sandbox_base: Path
) -> None:
    """A directory tree 3,000 deep on disk (no tmpfs: disk_gib=None) is removed by close, without recursion."""
    local = make(isolation=isolation, base_dir=sandbox_base, disk_gib=None)
    handle = await local.create(SandboxSpec())
    made = await local.exec(handle, _DEEP)
    assert made.return_code == 0, made.stderr
    outer = Path(handle.raw["root"]).parent
    await local.close(handle)
    assert not outer.exists()
    assert sandbox_dirs(sandbox_base) == []
