"""LocalProvider against hostile commands: each attack of the containment issue, run as untrusted code would.

Every test runs for ``isolation="bwrap"`` and ``isolation="none"``, except those marked bwrap-only
(what only a namespace can hide: capabilities, host files, sockets, other sandboxes). The machine
runs everything as root, the worst case: a sandboxed root must still get nowhere.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import (
    LocalProvider,
    OwnershipMiddleware,
    SandboxArgumentError,
    SandboxError,
    SandboxExpiredError,
    SandboxHandle,
    SandboxLimitError,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSpec,
    SandboxStatus,
    SandboxTransferLimitError,
    SandboxValueError,
    reap,
)

pytestmark = pytest.mark.anyio

HAS_BWRAP = shutil.which("bwrap") is not None
ISOLATIONS = [pytest.param("bwrap", marks=pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")), "none"]
bwrap_only = pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the limits tested here need root (cgroups, tmpfs)")


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make(sandbox_base: Path) -> AsyncIterator[Callable[..., LocalProvider]]:
    """Builds providers and closes every one of them after the test, even a failed one (before
    ``sandbox_base`` is removed, which is why it is requested here)."""
    made: list[LocalProvider] = []

    def build(**options: Any) -> LocalProvider:
        made.append(LocalProvider(**options))
        return made[-1]

    yield build
    for local in made:
        await local.aclose()


@pytest.fixture
def provider(make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path) -> LocalProvider:
    return make(isolation=isolation, base_dir=sandbox_base)


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A base_dir outside /tmp, where the old provider let sandboxes read each other."""
    base = Path("/var/tmp") / f"containment-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


# --- privileges and view of the host --------------------------------------------------------------


@bwrap_only
async def test_no_capabilities_and_remount_fails(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """No capability inside; remounting a read-only host directory read-write fails; the canary is unchanged."""
    shared = sandbox_base.parent / "shared"
    shared.mkdir()
    canary = shared / "canary.txt"
    canary.write_text("host")
    local = make(isolation="bwrap", base_dir=sandbox_base, ro_paths=[str(shared)])
    handle = await local.create(SandboxSpec())
    caps = await local.exec(handle, "grep -E '^Cap(Eff|Prm|Bnd|Amb):' /proc/self/status")
    assert {line.split()[1] for line in caps.stdout.splitlines()} == {"0000000000000000"}
    attack = await local.exec(
        handle,
        f"mount -o remount,bind,rw {shared} && echo pwned > {canary}; echo pwned > {canary}; "
        f"mount -t tmpfs none {shared} && echo mounted; cat {canary}",
    )
    assert "mounted" not in attack.stdout
    assert attack.stdout.strip() == "host"
    assert canary.read_text() == "host"
    nested = await local.exec(handle, "unshare -Ur true && echo nested")
    assert "nested" not in nested.stdout
    await local.aclose()


@bwrap_only
async def test_host_files_are_out_of_view(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """/etc/shadow, /root, /home, /run and the host's base_dir do not exist for a command."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    for path in ("/etc/shadow", "/root", "/home", "/run", "/var", "/sys", str(tmp_path)):
        result = await local.exec(handle, f"ls -d {path} || cat {path}")
        assert result.return_code != 0, path
        assert "No such file or directory" in result.stderr, path
    listing = await local.exec(handle, "ls / /etc")
    top = set(listing.stdout.split("\n\n")[0].split()[1:])
    assert top <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "workspace"}
    await local.aclose()


@bwrap_only
async def test_other_sandboxes_are_out_of_reach(make: Callable[..., LocalProvider], outside_tmp: Path) -> None:
    """With base_dir outside /tmp, one sandbox can neither read nor list another's files."""
    local = make(isolation="bwrap", base_dir=outside_tmp)
    first, second = await local.create(SandboxSpec()), await local.create(SandboxSpec())
    await local.exec(first, "echo secret > mine.txt")
    secret = Path(first.raw["root"]) / "mine.txt"
    assert secret.read_text() == "secret\n"
    attack = await local.exec(second, f"cat {secret}; ls {outside_tmp}; ls /workspace/..")
    assert "secret" not in attack.stdout
    assert first.sandbox_id not in attack.stdout
    await local.aclose()


@bwrap_only
async def test_host_unix_sockets_are_out_of_reach(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """Neither a filesystem socket in /run nor an abstract one on the host can be reached."""
    path = Path("/run") / f"containment-{uuid.uuid4().hex[:8]}.sock"
    abstract = f"\0containment-{uuid.uuid4().hex[:8]}"
    listeners = []
    for address in (str(path), abstract):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen()
        listeners.append(listener)
    local = make(isolation="bwrap", base_dir=sandbox_base)
    try:
        handle = await local.create(SandboxSpec())
        probe = (
            "import socket, sys\n"
            "for address in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(address.replace('@', '\\0'))\n"
            "        print('connected', address)\n"
            "    except OSError as exc:\n"
            "        print('refused', address, exc.errno)\n"
        )
        result = await local.exec(handle, f"python3 -c {_quote(probe)} {path} @{abstract[1:]}")
        assert "connected" not in result.stdout
        assert result.stdout.count("refused") == 2
    finally:
        await local.aclose()
        for listener in listeners:
            listener.close()
        path.unlink(missing_ok=True)


# --- environment and stdin ---------------------------------------------------------------------------


async def test_clean_environment(provider: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command sees the fixed base, then spec.env, then the call's env: nothing of the host's."""
    monkeypatch.setenv("TRAINER_API_KEY", "sk-very-secret")
    handle = await provider.create(SandboxSpec(env={"A": "spec", "B": "spec"}))
    result = await provider.exec(handle, "env -0", env={"B": "call"})
    env = dict(item.split("=", 1) for item in result.stdout.split("\0") if item)
    assert "sk-very-secret" not in result.stdout
    assert env["A"] == "spec" and env["B"] == "call"
    assert env["LANG"] == "C.UTF-8"
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    home = "/workspace" if provider.isolation == "bwrap" else handle.raw["root"]
    assert env["HOME"] == home
    expected = {"A", "B", "LANG", "PATH", "HOME", "PWD", "SHLVL", "_"}
    assert set(env) - {"TMPDIR"} == expected


async def test_pass_env_is_an_allow_list(
    make: Callable[..., LocalProvider],
    isolation: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_base: Path,
) -> None:
    """Only host variables named in pass_env reach a command."""
    monkeypatch.setenv("WANTED", "yes")
    monkeypatch.setenv("UNWANTED", "no")
    local = make(isolation=isolation, base_dir=sandbox_base, pass_env=["WANTED"])
    handle = await local.create(SandboxSpec())
    assert (await local.exec(handle, 'echo "$WANTED/$UNWANTED"')).stdout == "yes/\n"
    await local.aclose()


async def test_stdin_is_empty(provider: LocalProvider) -> None:
    """A command reading stdin gets end of file at once, never the trainer's stdin."""
    handle = await provider.create(SandboxSpec())
    with anyio.fail_after(20):
        result = await provider.exec(handle, "cat; readlink /proc/self/fd/0 || true; echo done")
    assert result.stdout.startswith("/dev/null") or result.stdout.endswith("done\n")
    assert result.stdout.endswith("done\n")
    assert result.stdout.splitlines()[0] == "/dev/null"


# --- race-free transfers -------------------------------------------------------------------------------

ATTEMPTS = 2000


async def test_symlink_swap_never_wins_a_download(provider: LocalProvider, tmp_path: Path) -> None:
    """A command swapping a file and a directory for symlinks to host paths never gets a host file out."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET")
    (tmp_path / "host-dir").mkdir()
    (tmp_path / "host-dir" / "f").write_text("HOST-SECRET")
    handle = await provider.create(SandboxSpec())
    swapper = (
        "mkdir -p d; echo inside > d/f; echo inside > f; "
        f"while true; do ln -sfn {secret} f; echo inside > f.new; mv -f f.new f; "
        f"mv d d.real; ln -sfn {tmp_path / 'host-dir'} d; rm d; mv d.real d; done"
    )
    outcomes: dict[str, int] = {}
    target = tmp_path / "out.txt"
    async with anyio.create_task_group() as group:
        group.start_soon(_run_quietly, provider, handle, swapper)
        await anyio.sleep(0.2)
        for attempt in range(ATTEMPTS):
            name = "f" if attempt % 2 else "d/f"
            try:
                await provider.download_file(handle, name, target)
            except SandboxPathError:
                outcomes["refused"] = outcomes.get("refused", 0) + 1
                continue
            except SandboxError:
                outcomes["missing"] = outcomes.get("missing", 0) + 1  # caught mid-rename
                continue
            content = target.read_text()
            assert content == "inside\n", f"attempt {attempt} read {content!r}"
            outcomes["inside"] = outcomes.get("inside", 0) + 1
        group.cancel_scope.cancel()
    assert outcomes.get("refused", 0) > 0, outcomes  # the race was really run


async def test_symlink_swap_never_wins_an_upload(provider: LocalProvider, tmp_path: Path) -> None:
    """Uploads racing a symlink swap never write a host file or into a host directory."""
    victim = tmp_path / "host-victim.txt"
    victim.write_text("untouched")
    victim_dir = tmp_path / "host-dir"
    victim_dir.mkdir()
    source = tmp_path / "payload.txt"
    source.write_text("payload")
    handle = await provider.create(SandboxSpec())
    swapper = (
        "mkdir -p d; "
        f"while true; do ln -sfn {victim} f; rm -f f; mv d d.real; ln -sfn {victim_dir} d; rm d; mv d.real d; done"
    )
    refused = 0
    async with anyio.create_task_group() as group:
        group.start_soon(_run_quietly, provider, handle, swapper)
        await anyio.sleep(0.2)
        for attempt in range(ATTEMPTS):
            try:
                await provider.upload_file(handle, source, "f" if attempt % 2 else "d/f")
            except SandboxPathError:
                refused += 1
            except SandboxError:
                pass  # caught mid-rename
        group.cancel_scope.cancel()
    assert victim.read_text() == "untouched"
    assert list(victim_dir.iterdir()) == []
    assert refused > 0


async def _run_quietly(provider: LocalProvider, handle: SandboxHandle, command: str) -> None:
    await provider.exec(handle, command, timeout_s=120)


# --- output, transfers and resources -------------------------------------------------------------------

_MEASURE = """
import anyio, json, resource, sys
from sandbox_middleware import LocalProvider, SandboxSpec

async def main():
    local = LocalProvider(isolation=sys.argv[1], base_dir=sys.argv[2])
    handle = await local.create(SandboxSpec())
    await local.exec(handle, "head -c 2M /dev/zero")  # warm up: the pipes, the threads, the buffers
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = await local.exec(handle, "head -c 300M /dev/urandom; echo END")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    await local.aclose()
    print(json.dumps({"growth_kib": after - before, "length": len(result.stdout), "tail": result.stdout[-4:],
                      "truncated": "bytes truncated" in result.stdout}))

anyio.run(main)
"""


async def test_huge_output_is_bounded(isolation: str, tmp_path: Path, sandbox_base: Path) -> None:
    """300 MB of output costs the host process under 50 MB and the result says it was truncated."""
    run = await anyio.run_process([sys.executable, "-c", _MEASURE, isolation, str(sandbox_base)], check=False)
    assert run.returncode == 0, run.stderr.decode()
    report = json.loads(run.stdout)
    assert report["growth_kib"] < 50 * 1024, report
    assert report["truncated"], report
    assert report["tail"] == "END\n"  # the tail is kept
    assert report["length"] < 3 * (1 << 20)  # 1 MiB per stream, replacement characters at most tripling it


async def test_output_keeps_head_and_tail(
    make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path
) -> None:
    """Truncated output keeps its first and last bytes and states how many were dropped."""
    local = make(isolation=isolation, base_dir=sandbox_base, max_output_bytes=1000)
    handle = await local.create(SandboxSpec())
    result = await local.exec(handle, "seq 1 100000; seq 1 10 >&2")
    assert result.stdout.startswith("1\n2\n3\n")
    assert result.stdout.endswith("99999\n100000\n")
    total = len("".join(f"{n}\n" for n in range(1, 100001)))
    assert f"[... {total - 1000} bytes truncated" in result.stdout
    assert result.stderr == "".join(f"{n}\n" for n in range(1, 11))
    await local.aclose()


async def test_sparse_file_download_is_refused(provider: LocalProvider, tmp_path: Path) -> None:
    """A 1 GiB sparse file is refused before anything is copied to the host."""
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "truncate -s 1G big.bin")
    with pytest.raises(SandboxTransferLimitError, match=r"'big.bin' is 1073741824 bytes, over max_transfer_bytes"):
        await provider.download_file(handle, "big.bin", tmp_path / "big.bin")
    assert not (tmp_path / "big.bin").exists()


@as_root
async def test_memory_limit(
    make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path
) -> None:
    """A 512 MiB allocation fails under memory_mib=64."""
    local = make(isolation=isolation, base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(resources={"memory_mib": 64}))
    result = await local.exec(handle, "python3 -c 'x = bytearray(512 << 20); print(\"allocated\")'")
    assert "allocated" not in result.stdout
    assert result.return_code != 0
    small = await local.exec(handle, "python3 -c 'x = bytearray(8 << 20); print(\"allocated\")'")
    assert small.stdout == "allocated\n"
    await local.aclose()


@as_root
async def test_fork_bomb_is_contained(
    make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path
) -> None:
    """A fork bomb hits the process limit; the host still starts processes; close leaves none running."""
    local = make(isolation=isolation, base_dir=sandbox_base, pids=64)
    handle = await local.create(SandboxSpec())
    result = await local.exec(handle, "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout_s=4)
    host = await anyio.run_process(["true"])
    assert host.returncode == 0
    groups = local._boxes[handle.sandbox_id].cgroups  # ground truth: the kernel's own list
    assert result.return_code is not None
    await local.close(handle)
    assert all(not group.exists() for group in groups)


@as_root
async def test_disk_bound(
    make: Callable[..., LocalProvider], isolation: str, tmp_path: Path, sandbox_base: Path
) -> None:
    """Writes beyond disk_gib fail inside the sandbox, in its directory and in its /tmp alike."""
    local = make(isolation=isolation, base_dir=sandbox_base, disk_gib=16 / 1024)  # spec.resources takes whole GiB
    handle = await local.create(SandboxSpec())
    shm = "; head -c 32M /dev/zero > /dev/shm/big" if isolation == "bwrap" else ""  # without isolation: the host's
    result = await local.exec(
        handle, f'head -c 32M /dev/zero > big; head -c 32M /dev/zero > "${{TMPDIR:-/tmp}}/big"{shm}'
    )
    assert result.stderr.count("No space left on device") == (3 if shm else 2)  # its files, /tmp, /dev/shm
    assert result.return_code != 0
    assert (Path(handle.raw["root"]) / "big").stat().st_size <= 16 << 20
    await local.aclose()


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


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@as_root
async def test_close_kills_escaped_sessions(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """A command that leaves its process group (setsid) still dies at close: the cgroup holds it."""
    local = make(isolation="none", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    pid = int((await local.exec(handle, "setsid sleep 60 > /dev/null 2>&1 & echo $!")).stdout)
    assert _alive(pid)
    await local.close(handle)
    with anyio.fail_after(10):
        while _alive(pid):
            await anyio.sleep(0.05)


@pytest.mark.skipif(os.geteuid() == 0, reason="as root every limit here is enforceable")
async def test_unenforceable_limit_is_refused(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:  # pragma: no cover - root machines
    local = make(base_dir=sandbox_base, limit_backend="rlimit")
    with pytest.raises(SandboxLimitError, match="cannot enforce cpu"):
        await local.create(SandboxSpec(resources={"cpu": 1}))


async def test_rlimit_backend_reports_and_refuses(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """Without cgroups, memory falls back to RLIMIT_AS (reported) and a CPU limit is refused at create."""
    local = make(base_dir=sandbox_base, limit_backend="rlimit")
    assert local.mechanisms["memory"] == "rlimit RLIMIT_AS (per process)"
    assert local.mechanisms["cpu"] == "not enforced"
    with pytest.raises(SandboxLimitError, match=r"cannot enforce cpu"):
        await local.create(SandboxSpec(resources={"cpu": 1}))
    assert list(sandbox_base.glob("local-*")) == []
    handle = await local.create(SandboxSpec(resources={"memory_mib": 64}))
    result = await local.exec(handle, "python3 -c 'x = bytearray(512 << 20); print(\"allocated\")'")
    assert "allocated" not in result.stdout
    await local.aclose()


# --- descriptors and deletion ----------------------------------------------------------------------


async def test_forged_descriptor_is_refused_and_deletes_nothing(
    make: Callable[..., LocalProvider], provider: LocalProvider, tmp_path: Path, sandbox_base: Path
) -> None:
    """A descriptor pointing at a host directory, or altered, or signed with another key, is refused."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    handle = await provider.create(SandboxSpec())
    genuine = await provider.serialize_handle(handle)
    forged = {**genuine, "root": str(victim)}
    for descriptor in (forged, {k: v for k, v in genuine.items() if k != "mac"}, {**genuine, "mac": "0" * 64}):
        with pytest.raises(SandboxError, match=r"signature|serialize_handle"):
            await provider.connect(descriptor)
    other = make(isolation=provider.isolation, base_dir=sandbox_base)
    with pytest.raises(SandboxError, match="signature does not match"):
        await other.connect(genuine)
    assert (victim / "keep.txt").read_text() == "keep"
    again = await provider.connect(genuine)
    assert (await provider.exec(again, "echo ok")).stdout == "ok\n"


async def test_descriptor_outside_base_dir_is_refused(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """A validly signed descriptor is still refused by a provider of another base_dir."""
    key = b"k" * 32
    first = make(base_dir=sandbox_base / "a", connect_key=key)
    second = make(base_dir=sandbox_base / "b", connect_key=key)
    handle = await first.create(SandboxSpec())
    with pytest.raises(SandboxError, match="not in this provider's base_dir"):
        await second.connect(await first.serialize_handle(handle))
    assert Path(handle.raw["root"]).is_dir()
    await first.aclose()


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


# --- bad arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda p, h, tmp: p.exec(h, "echo a\0b"), "command"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A": "x\0y"}), "env"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A\0": "x"}), "env name"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A=B": "x"}), "env name"),
        (lambda p, h, tmp: p.exec(h, "true", env={"A": 5}), "env"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s=math.nan), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s=-1), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", timeout_s="5"), "timeout_s"),
        (lambda p, h, tmp: p.exec(h, "true", cwd="a\0b"), "cwd"),
        (lambda p, h, tmp: p.upload_file(h, tmp / "src.txt", "x\0y"), "target_path"),
        (lambda p, h, tmp: p.upload_file(h, tmp / "src.txt", "n" * 300), "target_path"),
        (lambda p, h, tmp: p.download_file(h, "a\0b", tmp / "out"), "source_path"),
        (lambda p, h, tmp: p.download_file(h, "f", Path(str(tmp) + "/o\0ut")), "target_path"),
    ],
)
async def test_bad_arguments_are_typed_errors(
    provider: LocalProvider, tmp_path: Path, call: object, argument: str
) -> None:
    """Each unusable argument raises SandboxArgumentError naming it, never a raw ValueError or OSError."""
    (tmp_path / "src.txt").write_text("x")
    handle = await provider.create(SandboxSpec())
    with pytest.raises(SandboxArgumentError, match=argument):
        await call(provider, handle, tmp_path)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("spec", "argument"),
    [
        (lambda: SandboxSpec(env={"A": "x\0"}), "spec.env"),
        (lambda: SandboxSpec(ttl_s=math.nan), "spec.ttl_s"),
        (lambda: SandboxSpec(ttl_s=-1), "spec.ttl_s"),
        (lambda: SandboxSpec(ttl_s=1e10), "spec.ttl_s"),
        (lambda: SandboxSpec(workdir="w\0"), "spec.workdir"),
        (lambda: SandboxSpec(workdir="w" * 300), "spec.workdir"),
        (lambda: SandboxSpec(workdir="/"), "spec.workdir"),
        (lambda: SandboxSpec(workdir="/proc/x"), "spec.workdir"),
        (lambda: SandboxSpec(entrypoint=["server"]), "entrypoint"),
        (lambda: SandboxSpec(resources={"memory_mib": -64}), "resources.memory_mib"),
        (lambda: SandboxSpec(resources={"memory_mib": 10**30}), "resources.memory_mib"),
        (lambda: SandboxSpec(resources={"disk_gib": math.inf}), "disk_gib"),
        (lambda: SandboxSpec(resources={"cpu": "two"}), "cpu"),
    ],
)
async def test_bad_specs_are_typed_errors_and_leave_nothing(
    provider: LocalProvider, spec: Callable[[], SandboxSpec], argument: str, sandbox_base: Path
) -> None:
    """A bad spec is refused (by the spec itself, or at create) before anything is made: no directory, no cgroup."""
    with pytest.raises(SandboxValueError, match=argument):
        await provider.create(spec())
    assert not sandbox_base.exists() or list(sandbox_base.iterdir()) == []


@as_root
async def test_failed_create_leaves_nothing_behind(
    make: Callable[..., LocalProvider],
    provider: LocalProvider,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_base: Path,
) -> None:
    """A create that fails half-way (its disk too small for its own files) removes what it made."""
    known = uuid.UUID(int=0xDEAD)
    monkeypatch.setattr("sandbox_middleware.providers.local._provider.uuid.uuid4", lambda: known)
    tiny = make(isolation=provider.isolation, base_dir=sandbox_base, disk_gib=1e-9)
    with pytest.raises(SandboxError, match="cannot create a sandbox"):
        await tiny.create(SandboxSpec())
    assert list(sandbox_base.iterdir()) == []
    leftovers = list(Path("/sys/fs/cgroup").glob(f"**/sandbox-middleware/local-{known.hex[:12]}"))
    assert leftovers == []


# --- the event loop ------------------------------------------------------------------------------------


async def test_transfers_do_not_block_the_event_loop(provider: LocalProvider, tmp_path: Path) -> None:
    """A 100 MB upload and its download run off the loop: another task keeps ticking meanwhile."""
    source = tmp_path / "big.bin"
    with source.open("wb") as out:
        out.truncate(100 << 20)
    handle = await provider.create(SandboxSpec())
    for transfer in (
        lambda: provider.upload_file(handle, source, "big.bin"),
        lambda: provider.download_file(handle, "big.bin", tmp_path / "back.bin"),
    ):
        done = anyio.Event()
        ticks = 0
        async with anyio.create_task_group() as group:
            group.start_soon(_then_set, transfer, done)
            while not done.is_set():
                ticks += 1
                await anyio.lowlevel.checkpoint()
        assert ticks > 1
    assert (tmp_path / "back.bin").stat().st_size == 100 << 20


async def _then_set(call: Callable[[], Awaitable[None]], done: anyio.Event) -> None:
    await call()
    done.set()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


async def test_absolute_workdir(provider: LocalProvider, tmp_path: Path) -> None:
    """An absolute workdir: under bwrap the sandbox is seen there; without isolation it maps onto the sandbox."""
    handle = await provider.create(SandboxSpec(workdir="/workspace/project"))
    source = tmp_path / "in.txt"
    source.write_text("data")
    await provider.upload_file(handle, source, "/workspace/project/in.txt")
    result = await provider.exec(handle, 'cat in.txt; echo; echo "$HOME"; pwd')
    lines = result.stdout.splitlines()
    assert lines[0] == "data"
    if provider.isolation == "bwrap":
        assert lines[1:] == ["/workspace/project", "/workspace/project"]
    else:
        assert lines[1:] == [handle.raw["root"], handle.raw["root"]]
    assert (Path(handle.raw["root"]) / "in.txt").read_text() == "data"
    await provider.download_file(handle, "/workspace/project/in.txt", tmp_path / "back.txt")
    assert (tmp_path / "back.txt").read_text() == "data"
    with pytest.raises(SandboxPathError, match="outside the sandbox"):
        await provider.upload_file(handle, source, "/etc/in.txt")


def test_cgroup_v2_layout(tmp_path: Path) -> None:
    """On a cgroup v2 machine the same limits land in v2's files (checked on a v2-shaped directory:
    this machine's controllers are all on v1, so the real v2 path cannot run here)."""
    from sandbox_middleware.providers.local._cgroups import CgroupBackend
    from sandbox_middleware.providers.local._limits import Limits

    (tmp_path / "cgroup.controllers").write_text("cpu memory pids io\n")
    own = next(
        (
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.startswith("0::")
        ),
        "/",
    )
    parent = tmp_path / own.lstrip("/") / "sandbox-middleware"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("cpu memory pids\n")
    backend = CgroupBackend(root=tmp_path)
    assert backend.version == "v2"
    assert backend.resources == {"cpu", "memory", "pids"}
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    limits = Limits(memory_bytes=64 << 20, pids=32, cpu=0.5, disk_bytes=None)
    (group,) = backend.create("local-000000000001", limits)
    assert group == parent / "local-000000000001"
    assert (group / "memory.max").read_text() == str(64 << 20)
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "pids.max").read_text() == "32"
    assert (group / "cpu.max").read_text() == "50000 100000"
    assert backend.groups_of("local-000000000001") == [group]


# --- regressions from the attacker's review --------------------------------------------------------


@bwrap_only
@as_root
async def test_host_kernel_settings_and_keyrings_are_out_of_reach(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """Commands run as an unprivileged host uid: /proc/sys is not writable, the kernel keyring calls
    are denied (seccomp), / and /dev are read-only, and what they write belongs to that uid on the host."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    setting = Path("/proc/sys/kernel/printk_ratelimit_burst")
    before = setting.read_text()
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('keyctl', libc.syscall(250, 0, -3, 0), ctypes.get_errno())\n"  # KEYCTL_GET_KEYRING_ID
        "print('add_key', libc.syscall(248, b'user', b'k', b'v', 1, -3), ctypes.get_errno())\n"
    )
    result = await local.exec(
        handle,
        f"echo 99 > {setting}; echo x > /new; echo x > /dev/new; touch mine; python3 -c {_quote(probe)}"
        if os.uname().machine == "x86_64"
        else f"echo 99 > {setting}; touch mine",
    )
    assert setting.read_text() == before
    assert "Permission denied" in result.stderr
    if os.uname().machine == "x86_64":
        assert result.stderr.count("Read-only file system") == 2
        assert "keyctl -1 1" in result.stdout and "add_key -1 1" in result.stdout  # EPERM
    owner = (Path(handle.raw["root"]) / "mine").stat()
    assert owner.st_uid == owner.st_gid == local._boxes[handle.sandbox_id].uid
    assert owner.st_uid not in (0, 65534)  # its own uid, shared with no account and no other sandbox


@bwrap_only
async def test_command_env_never_reaches_host_helpers(
    make: Callable[..., LocalProvider], sandbox_base: Path, tmp_path: Path
) -> None:
    """LD_PRELOAD and the like in spec.env or the call's env apply inside the sandbox only, never to
    the host-side processes that set it up (sh, setpriv, bwrap)."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(env={"LD_PRELOAD": "/nonexistent/spec.so"}))
    result = await local.exec(handle, 'echo "$LD_PRELOAD"', env={"LD_LIBRARY_PATH": "/workspace"})
    assert result.return_code == 0
    assert result.stdout == "/nonexistent/spec.so\n"
    # a host helper given that LD_PRELOAD would print the loader's complaint before the command ran
    assert "cannot be preloaded" in result.stderr  # bash inside loads it: the env is the command's own
    assert result.stderr.count("cannot be preloaded") == 1


async def test_cancelled_exec_leaves_no_process_group_to_signal_later(provider: LocalProvider) -> None:
    """A cancelled command is killed and forgotten: nothing a later close could signal by a reused pid."""
    handle = await provider.create(SandboxSpec())
    for _ in range(5):
        with anyio.move_on_after(0.2):
            await provider.exec(handle, "sleep 30")
    assert provider._boxes[handle.sandbox_id].groups == set()


async def test_a_huge_ttl_does_not_stop_other_ttls(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """A TTL near the maximum neither breaks the watchdog nor delays another sandbox's shorter TTL."""
    local = make(isolation="none", base_dir=sandbox_base)
    await local.create(SandboxSpec(ttl_s=29 * 24 * 3600))
    short = await local.create(SandboxSpec(ttl_s=1))
    pid = int((await local.exec(short, "setsid sleep 60 > /dev/null 2>&1 & echo $!")).stdout)
    with anyio.fail_after(20):
        while _alive(pid):
            await anyio.sleep(0.1)


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


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda p, h: p.exec(h, "true", timeout_s="1"), "timeout_s"),
        (lambda p, h: p.exec(h, "echo \ud800"), "command"),
        (lambda p, h: p.exec(h, "true", env={"A": "\ud800"}), "env"),
        (lambda p, h: p.exec(h, "true", cwd="\ud800"), "cwd"),
        (lambda p, h: p.upload_file(h, 3, "a"), "source_path"),
        (lambda p, h: p.download_file(h, "a", 3), "target_path"),
        (lambda p, h: p.upload_file(h, Path("/etc/hostname"), "\ud800"), "target_path"),
    ],
)
async def test_more_bad_arguments_are_typed(provider: LocalProvider, call: Any, argument: str) -> None:
    handle = await provider.create(SandboxSpec())
    with pytest.raises(SandboxArgumentError, match=argument):
        await call(provider, handle)


async def test_huge_timeout_means_none(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    assert (await provider.exec(handle, "echo ok", timeout_s=10**400)).stdout == "ok\n"


async def test_descriptor_with_odd_mac_or_nesting_is_a_sandbox_error(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    genuine = await provider.serialize_handle(handle)
    nested: dict[str, Any] = {}
    for _ in range(100_000):
        nested = {"x": nested}
    for descriptor in ({**genuine, "mac": "é" * 64}, {**genuine, "env": nested}, {"mac": "0" * 64}):
        with pytest.raises(SandboxError):
            await provider.connect(descriptor)


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"memory_mib": 10**400}, "memory_mib"),
        ({"pids": 0.5}, "pids"),
        ({"base_dir": "/tmp/a\0b"}, "base_dir"),
        ({"ro_paths": ["relative/path"]}, "ro_paths"),
        ({"ro_paths": ["/does/not/exist"]}, "ro_paths"),
        ({"sandbox_uid": 0}, "sandbox_uid"),
    ],
)
def test_bad_provider_options_are_typed(options: dict[str, Any], argument: str) -> None:
    with pytest.raises(SandboxArgumentError, match=argument):
        LocalProvider(**options)


# --- regressions from the second review ------------------------------------------------------------


async def test_listing_takes_nothing_over(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """Another provider's list(), a dry-run reap and its aclose() leave a live owner's sandboxes running."""
    owner = make(isolation="none", base_dir=sandbox_base)
    owned = await OwnershipMiddleware(owner, run_id="live").create(SandboxSpec())
    plain = await owner.create(SandboxSpec())
    other = make(isolation="none", base_dir=sandbox_base)
    assert len(await other.list()) == 2
    assert await reap(other, dry_run=True) == []
    await other.aclose()
    for handle in (owned, plain):
        assert (await owner.exec(handle, "echo alive")).stdout == "alive\n"


@as_root
async def test_layout_gives_the_sandbox_uid_nothing_of_ours(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """The sandbox directory and its record are root's; box, tmp and shm are the sandbox uid's, 0700;
    nothing is reachable for other users, and the mount is nosuid."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(env={"TOKEN": "secret"}))
    outer = Path(handle.raw["root"]).parent
    uid = local._boxes[handle.sandbox_id].uid
    assert (outer.stat().st_uid, oct(outer.stat().st_mode & 0o777)) == (0, "0o711")
    record = (outer / "meta.json").stat()
    assert (record.st_uid, oct(record.st_mode & 0o777)) == (0, "0o600")
    for name in ("box", "tmp", "shm"):
        info = (outer / name).stat()
        assert (info.st_uid, oct(info.st_mode & 0o777)) == (uid, "0o700"), name
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {outer} " in line]
    assert mounts and "nosuid" in mounts[0] and "nodev" in mounts[0]
    unbounded = make(isolation="bwrap", base_dir=sandbox_base, disk_gib=None)
    handle = await unbounded.create(SandboxSpec())
    outer = Path(handle.raw["root"]).parent
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {outer} " in line]
    assert mounts and "nosuid" in mounts[0]


async def test_planted_directories_are_ignored(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """Entries in base_dir that are not ours (another owner, a symlink, a FIFO or deep JSON as the
    record, a second copy of a live id) are neither listed nor reaped."""
    local = make(isolation="none", base_dir=sandbox_base)
    live = await OwnershipMiddleware(local, run_id="r").create(SandboxSpec())
    record = {"metadata": {"sandbox_middleware.run_id": "r", "sandbox_middleware.owner.host": "h",
                           "sandbox_middleware.owner.pid": "1", "sandbox_middleware.owner.started": "x"}}  # fmt: skip
    copy = sandbox_base / f"{live.sandbox_id}-planted"  # a second directory claiming the live id
    copy.mkdir(mode=0o711)
    (copy / "meta.json").write_text(json.dumps(record))
    (copy / "meta.json").chmod(0o600)
    fifo = sandbox_base / "local-0000000000aa-fifo"
    fifo.mkdir(mode=0o711)
    os.mkfifo(fifo / "meta.json", 0o600)
    deep = sandbox_base / "local-0000000000bb-deep"
    deep.mkdir(mode=0o711)
    (deep / "meta.json").write_text("[" * 100_000)
    (deep / "meta.json").chmod(0o600)
    foreign = sandbox_base / "local-0000000000cc-foreign"
    foreign.mkdir(mode=0o711)
    (foreign / "meta.json").write_text(json.dumps(record))
    os.chown(foreign, 12345, 12345)
    with anyio.fail_after(20):
        assert await local.list() == []  # the live one is hidden by its planted twin, the rest are not ours
        assert await reap(local, run_id="r", force=True) == []
    assert (await local.exec(live, "echo alive")).stdout == "alive\n"
    for planted in (copy, fifo, deep, foreign):
        shutil.rmtree(planted)


def test_base_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(SandboxArgumentError, match="no one else can write"):
        LocalProvider(isolation="none", base_dir=shared)


@as_root
async def test_aclose_keeps_the_shared_cgroup_parent(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """One provider's aclose never breaks another's next create."""
    first, second = make(isolation="none", base_dir=sandbox_base), make(isolation="none", base_dir=sandbox_base)
    await second.create(SandboxSpec())
    await second.aclose()
    handle = await first.create(SandboxSpec())
    assert (await first.exec(handle, "echo ok")).stdout == "ok\n"


@bwrap_only
async def test_vsock_is_refused(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """AF_VSOCK, which no network namespace covers, cannot even be opened."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    probe = (
        "import socket\ntry:\n    socket.socket(40, socket.SOCK_STREAM)\n    print('opened')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    other = "python3 -c 'import socket; socket.socket(); print(1)'"
    result = await local.exec(handle, f"python3 -c {_quote(probe)}; {other}")
    assert result.stdout.splitlines() == ["refused 1", "1"]  # EPERM; other families still work


async def test_exec_after_close_is_not_found(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)
    with pytest.raises(SandboxNotFoundError):
        await provider.exec(handle, "true")


@pytest.mark.parametrize("workdir", ["//etc", "//proc", "/usr/.", "/workspace/../etc"])
async def test_reserved_workdirs_after_normalising(provider: LocalProvider, workdir: str) -> None:
    with pytest.raises(SandboxArgumentError, match="system directory"):
        await provider.create(SandboxSpec(workdir=workdir))


async def test_fifo_upload_source_does_not_hang(provider: LocalProvider, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    handle = await provider.create(SandboxSpec())
    with anyio.fail_after(10), pytest.raises(SandboxError, match="not a regular file"):
        await provider.upload_file(handle, fifo, "x")


async def test_more_odd_inputs(provider: LocalProvider) -> None:
    """A missing handle, metadata that is no mapping, and a GPU request are typed errors."""
    with pytest.raises(SandboxArgumentError, match="handle"):
        await provider.exec(None, "true")  # type: ignore[arg-type]
    with pytest.raises(SandboxArgumentError, match="metadata"):
        await provider.create(SandboxSpec(metadata=["x"]))  # type: ignore[arg-type]
    with pytest.raises(SandboxLimitError, match="GPU"):
        await provider.create(SandboxSpec(resources={"gpu": 1}))
