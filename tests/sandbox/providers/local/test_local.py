"""LocalProvider: real subprocesses in real directories."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    BwrapUnavailableError,
    LocalProvider,
    SandboxError,
    SandboxHandle,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSpec,
    SandboxStatus,
)

pytestmark = pytest.mark.anyio

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed")


@pytest.fixture
async def local(tmp_path: Path, sandbox_base: Path) -> AsyncIterator[LocalProvider]:
    """Without isolation, so tests can look at host pids and paths (bwrap: containment/)."""
    provider = LocalProvider(isolation="none", base_dir=sandbox_base)
    yield provider
    await provider.aclose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


async def test_exec_output_exit_code_env_cwd(local: LocalProvider) -> None:
    """Exec returns stdout, stderr and the exit code, with the spec's env, the call's env and cwd."""
    handle = await local.create(SandboxSpec(env={"A": "spec", "B": "spec"}, workdir="work"))
    result = await local.exec(handle, 'echo "$A $B $PWD"; echo oops >&2; exit 3', env={"B": "call"})
    root = Path(handle.raw["root"])
    assert result.stdout == f"spec call {root / 'work'}\n"
    assert result.stderr == "oops\n"
    assert result.return_code == 3
    assert result.error_type is None
    (root / "sub").mkdir()
    assert (await local.exec(handle, "pwd", cwd="sub")).stdout == f"{root / 'sub'}\n"
    await local.close(handle)


async def test_missing_cwd_is_a_clear_error(local: LocalProvider) -> None:
    """A cwd that does not exist in the sandbox is a SandboxError naming it, not an OSError."""
    handle = await local.create(SandboxSpec())
    with pytest.raises(SandboxError, match="cwd 'nowhere' is not a directory"):
        await local.exec(handle, "true", cwd="nowhere")
    await local.close(handle)


async def test_missing_files_are_clear_errors(local: LocalProvider, tmp_path: Path) -> None:
    """A missing local source or sandbox file is a SandboxError that names both ends."""
    handle = await local.create(SandboxSpec())
    with pytest.raises(SandboxError, match=r"cannot upload .*missing\.txt to 'in\.txt'"):
        await local.upload_file(handle, tmp_path / "missing.txt", "in.txt")
    with pytest.raises(SandboxError, match=r"'nothing\.txt' is not a file"):
        await local.download_file(handle, "nothing.txt", tmp_path / "out.txt")
    await local.close(handle)


async def test_timeout_kills_the_process_group(local: LocalProvider) -> None:
    """A timeout kills the whole group, including a child, and says so in the result."""
    handle = await local.create(SandboxSpec())
    result = await local.exec(handle, "sleep 30 & echo $!; wait", timeout_s=0.5)
    assert result.error_type == "timeout"
    assert result.return_code != 0
    child = int(result.stdout.strip())
    with anyio.fail_after(5):
        while _alive(child):
            await anyio.sleep(0.05)
    await local.close(handle)


async def test_background_child_is_gone_after_close(local: LocalProvider) -> None:
    """A command returns while its background child runs on; close kills the child."""
    handle = await local.create(SandboxSpec())
    result = await local.exec(handle, "sleep 60 > /dev/null 2>&1 & echo $!")
    assert result.return_code == 0
    child = int(result.stdout.strip())
    assert _alive(child)
    root = Path(handle.raw["root"])
    await local.close(handle)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert not _alive(child)
    assert not root.exists()
    assert await local.status(handle) == SandboxStatus.STOPPED


async def test_background_child_holding_stdout_does_not_block(local: LocalProvider) -> None:
    """A background child that keeps stdout open does not hold the exec call."""
    handle = await local.create(SandboxSpec())
    with anyio.fail_after(10):
        result = await local.exec(handle, "sleep 30 & echo started")
    assert result.stdout == "started\n"
    await local.close(handle)


async def test_upload_download_round_trip(local: LocalProvider, tmp_path: Path) -> None:
    """A file uploaded into the sandbox is visible to commands and downloads back unchanged."""
    handle = await local.create(SandboxSpec())
    source = tmp_path / "in.bin"
    source.write_bytes(b"\x00\x01payload")
    await local.upload_file(handle, source, "data/in.bin")
    assert (await local.exec(handle, "wc -c < data/in.bin")).stdout.strip() == "9"
    await local.exec(handle, "cp data/in.bin out.bin")
    await local.download_file(handle, "out.bin", tmp_path / "back" / "out.bin")
    assert (tmp_path / "back" / "out.bin").read_bytes() == b"\x00\x01payload"
    await local.close(handle)


@pytest.mark.parametrize("target", ["../escape.txt", "a/../../escape.txt", "/etc/passwd-copy", "link/escape.txt"])
async def test_paths_that_escape_are_refused(local: LocalProvider, tmp_path: Path, target: str) -> None:
    """Targets leaving the sandbox by .., an absolute path or a symlink are refused, both directions."""
    handle = await local.create(SandboxSpec())
    await local.exec(handle, f"ln -s {tmp_path} link")
    source = tmp_path / "in.txt"
    source.write_text("x")
    with pytest.raises(SandboxPathError, match="outside the sandbox"):
        await local.upload_file(handle, source, target)
    with pytest.raises(SandboxPathError, match="outside the sandbox"):
        await local.download_file(handle, target, tmp_path / "out.txt")
    assert not (tmp_path / "escape.txt").exists()
    await local.close(handle)


async def test_closed_or_unknown_handle_is_a_clear_error(local: LocalProvider) -> None:
    """Operations on a closed sandbox raise SandboxNotFoundError naming it; close is idempotent."""
    handle = await local.create(SandboxSpec())
    assert await local.status(handle) == SandboxStatus.RUNNING
    await local.close(handle)
    await local.close(handle)
    with pytest.raises(SandboxNotFoundError, match=handle.sandbox_id):
        await local.exec(handle, "true")
    assert await local.status(SandboxHandle("x", "other")) == SandboxStatus.UNKNOWN


async def test_connect_rebuilds_a_handle(tmp_path: Path, sandbox_base: Path) -> None:
    """A serialized handle connects in another provider instance sharing the key and reaches the same directory."""
    local = LocalProvider(isolation="none", base_dir=sandbox_base, connect_key=b"k" * 32)
    handle = await local.create(SandboxSpec(env={"K": "v"}))
    await local.exec(handle, "echo hi > f")
    other = LocalProvider(isolation="none", base_dir=sandbox_base, connect_key=b"k" * 32)
    again = await other.connect(await local.serialize_handle(handle))
    assert (await other.exec(again, "cat f; echo $K")).stdout == "hi\nv\n"
    await local.close(handle)


def test_bwrap_missing_is_a_construction_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for bwrap where it is absent fails at construction and says what to install."""
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BwrapUnavailableError, match="apt-get install -y bubblewrap"):
        LocalProvider(isolation="bwrap")


@needs_bwrap
async def test_bwrap_isolation(tmp_path: Path, sandbox_base: Path) -> None:
    """Under bwrap there is no network, the root is read-only, and the sandbox is writable."""
    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    net = await local.exec(handle, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert net.stdout.split() == ["lo"]
    connect = await local.exec(handle, "exec 3<>/dev/tcp/127.0.0.1/9 && echo connected || echo refused", timeout_s=10)
    assert "connected" not in connect.stdout
    ro = await local.exec(handle, "touch /usr/should-fail")
    assert ro.return_code != 0 and "Read-only file system" in ro.stderr
    rw = await local.exec(handle, "echo ok > here.txt && cat here.txt")
    assert rw.stdout == "ok\n"
    assert (Path(handle.raw["root"]) / "here.txt").read_text() == "ok\n"
    pid1 = await local.exec(handle, "ps -o pid= -p 1 >/dev/null 2>&1; ls /proc | grep -c '^[0-9]'")
    assert int(pid1.stdout.strip()) < 10
    await local.close(handle)


async def test_list_finds_sandboxes_of_other_instances_by_metadata(tmp_path: Path, sandbox_base: Path) -> None:
    """list() finds every sandbox in base_dir by metadata, made by any instance, and adopts it for close."""
    maker = LocalProvider(isolation="none", base_dir=sandbox_base)
    run_a = await maker.create(SandboxSpec(metadata={"run": "a", "k": "1"}, ttl_s=600))
    run_b = await maker.create(SandboxSpec(metadata={"run": "b"}))
    await maker.exec(run_a, "echo kept > f")
    finder = LocalProvider(isolation="none", base_dir=sandbox_base)
    everything = await finder.list()
    assert {listing.handle.sandbox_id for listing in everything} == {run_a.sandbox_id, run_b.sandbox_id}
    (found,) = await finder.list(metadata={"run": "a"})
    assert found.handle.sandbox_id == run_a.sandbox_id
    assert found.metadata == {"run": "a", "k": "1"}
    assert found.created_at is not None and found.created_at <= time.time()
    await finder.aclose()  # listing took nothing over: closing the finder closes nothing
    assert (await maker.exec(run_a, "cat f")).stdout == "kept\n"
    with pytest.raises(SandboxNotFoundError):
        await finder.exec(found.handle, "true")  # commands need connect(); close is what a listing is for
    await finder.close(found.handle)
    assert not Path(run_a.raw["root"]).exists()
    assert [listing.handle.sandbox_id for listing in await maker.list()] == [run_b.sandbox_id]
    await maker.aclose()
    await finder.aclose()


async def test_pickles_as_its_options(sandbox_base: Path) -> None:
    """A pickled provider comes back with the same options and no sandboxes; with a shared key it connects."""
    import pickle

    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base, memory_mib=512, connect_key=b"k" * 32)
    handle = await local.create(SandboxSpec())
    copy = pickle.loads(pickle.dumps(local))
    measured = "memory budget"  # what the machine uses now, which moves between two readings
    mechanisms = {name: value for name, value in local.mechanisms.items() if name != measured}
    assert copy.isolation == "bwrap" and {k: v for k, v in copy.mechanisms.items() if k != measured} == mechanisms
    assert copy._defaults == local._defaults and copy._boxes == {}
    again = await copy.connect(await local.serialize_handle(handle))
    assert (await copy.exec(again, "echo ok")).stdout == "ok\n"
    await local.aclose()
