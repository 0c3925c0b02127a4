"""The host's shared pools: the enclosing cgroup's memory, TCP buffers, the file table, ptys, per-uid counters.

A sandbox within its own limits must not take what the trainer, other sandboxes or the host need:
each attack fills one pool from inside a sandbox and the test looks at the host (the trainer is
alive, the host's counters stayed far from their maximum, the other sandbox still works). Some run
again as an unprivileged user (``run_unprivileged``), where the provider enforces them differently.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import LocalProvider, SandboxSpec
from sandbox_middleware.providers._common import _uids
from sandbox_middleware.providers.local._cgroups import file_max

from ._support import as_root, bwrap_only, run_unprivileged

pytestmark = pytest.mark.anyio

_MiB = 1 << 20


def _own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


@pytest.fixture
def enclosing_cgroup() -> Iterator[Path]:
    """A 1 GiB memory cgroup (v1) below this process's own, as a Kubernetes pod or a Slurm job would be;
    removed afterwards with the sandboxes' parent the provider made in it."""
    own = _own_memory_cgroup()
    if os.geteuid() != 0 or own is None or not (own / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a writable cgroup v1 memory hierarchy (this machine kind has one)")
    group = own / f"test-enclosing-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(1 << 30))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(1 << 30))
        yield group
    finally:
        for child in sorted(group.glob("sandbox-middleware/*/"), reverse=True):
            child.rmdir()
        for child in (group / "sandbox-middleware", group):
            if child.exists():
                child.rmdir()


_TRAINER = """
import anyio, json, sys
from sandbox_middleware import LocalProvider, SandboxLimitError, SandboxSpec

async def main():
    held = bytearray(b"\\x01") * (300 << 20)  # the trainer's own memory, touched
    local = LocalProvider(isolation=sys.argv[1], base_dir=sys.argv[2])
    report = {"budget": local.mechanisms["memory budget"]}
    try:
        await local.create(SandboxSpec())  # the default 4096 MiB is beyond what this cgroup can give
    except SandboxLimitError as exc:
        report["default refused"] = str(exc)
    handle = await local.create(SandboxSpec(resources={"memory_mib": 256, "disk_gib": 1}))
    fill = await local.exec(handle, 'head -c 900M /dev/zero > "${TMPDIR:-/tmp}/fill" && echo written', timeout_s=120)
    report["fill"] = [fill.return_code, fill.stdout]
    try:
        await local.create(SandboxSpec(resources={"memory_mib": 512}))  # its tmpfs holds 256 MiB: 512 more is too much
    except SandboxLimitError as exc:
        report["second refused"] = str(exc)
    await local.aclose()
    report["held"] = len(held)
    print(json.dumps(report))

anyio.run(main, backend=sys.argv[3])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_trainer_survives_a_sandbox_filling_its_tmpfs(
    enclosing_cgroup: Path, isolation: str, backend: str, sandbox_base: Path
) -> None:
    """A trainer holding 300 MiB in a 1 GiB cgroup: a default-sized sandbox is refused (it would
    exceed the budget), a 256 MiB one writing 900 MiB to its tmpfs dies alone, the trainer lives."""
    join = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
    argv = ["/bin/sh", "-c", join, "sh", str(enclosing_cgroup), sys.executable, "-c", _TRAINER]
    run = await anyio.run_process([*argv, isolation, str(sandbox_base), backend], check=False)
    assert run.returncode == 0, (run.returncode, run.stderr.decode()[-2000:])  # -9: the trainer was OOM-killed
    report = json.loads(run.stdout)
    assert report["held"] == 300 * _MiB
    assert "memory budget" in report["default refused"] and "4096 MiB" in report["default refused"]
    assert "memory budget" in report["second refused"]
    code, stdout = report["fill"]
    assert "written" not in stdout and code != 0  # the writer was killed inside the sandbox's own cgroup
    assert int((enclosing_cgroup / "memory.failcnt").read_text()) == 0  # the enclosing cgroup never filled
    assert str(sandbox_base) not in Path("/proc/self/mountinfo").read_text()  # close unmounted its tmpfs
    assert list(enclosing_cgroup.glob("sandbox-middleware/local-*")) == []  # and removed its cgroups


_TCP = """
import json, socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(128)
chunk, total, pairs = b"x" * (1 << 20), 0, []
for _ in range(100):
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    client.setblocking(False)
    pairs.append((client, peer))
    while True:
        try:
            sent = client.send(chunk)
        except OSError:
            break
        if not sent:
            break
        total += sent
print(json.dumps(total))
"""


@as_root
async def test_tcp_buffers_beyond_memory_fail_inside(
    make: Callable[..., LocalProvider], isolation: str, sandbox_base: Path
) -> None:
    """Loopback TCP buffers a command fills without reading stop near memory_mib (cgroup v1's
    kmem.tcp limit); without cgroups (the control) the same command buffers far more."""
    limited = make(isolation=isolation, base_dir=sandbox_base)
    assert "tcp" in limited.mechanisms["tcp buffers"]
    handle = await limited.create(SandboxSpec(resources={"memory_mib": 64}))
    result = await limited.exec(handle, f"python3 -c '{_TCP}'", timeout_s=60)
    assert result.return_code == 0, result.stderr
    buffered = json.loads(result.stdout)
    assert buffered < 64 * _MiB * 1.25, buffered / _MiB
    control = make(
        isolation=isolation, base_dir=sandbox_base / "control", limit_backend="rlimit", memory_mib=None, pids=None
    )
    assert control.mechanisms["tcp buffers"] == "not limited"
    unlimited = await control.exec(await control.create(SandboxSpec()), f"python3 -c '{_TCP}'", timeout_s=60)
    assert json.loads(unlimited.stdout) > 2 * 64 * _MiB  # the attack is real: only the limit stopped it
    await limited.aclose()
    await control.aclose()


_FILES = """
import json, os
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    print(json.dumps([len(fds), exc.errno]), flush=True)
"""


async def _fill_file_table(local: LocalProvider, processes: int) -> tuple[list[list[int]], int]:
    """Open files until refused in one process, then in ``processes`` at once; the host's open-file
    count seen while they all hold theirs, less the count before."""
    handle = await local.create(SandboxSpec())
    one = await local.exec(handle, f"python3 -c '{_FILES}'")
    assert one.return_code == 0, one.stderr
    before = int(Path("/proc/sys/fs/file-nr").read_text().split()[0])
    holders = (  # each holds its files a while; the host's count is read (in the sandbox) while all do
        f"for i in $(seq {processes}); do python3 -c '{_FILES}\nimport time\ntime.sleep(4)' & done; "
        "sleep 3; cat /proc/sys/fs/file-nr; wait"
    )
    many = await local.exec(handle, holders, timeout_s=60)
    *lines, during = many.stdout.splitlines()
    return [json.loads(one.stdout), *map(json.loads, lines)], int(during.split()[0]) - before


async def test_open_files_stop_at_the_sandbox_limit(
    make: Callable[..., LocalProvider], isolation: str, sandbox_base: Path
) -> None:
    """Each process stops at RLIMIT_NOFILE (EMFILE, 24) and all sandboxes together can hold at most
    a quarter of fs.file-max (their processes are capped on the shared parent cgroup)."""
    local = make(isolation=isolation, base_dir=sandbox_base, nofile=128)
    counts, _ = await _fill_file_table(local, 4)
    assert all(count <= 128 and errno == 24 for count, errno in counts), counts
    assert counts[0][0] >= 100  # the limit, not something else, stopped it
    if os.geteuid() == 0:  # the cap on all sandboxes' processes, read from the kernel
        parent = (
            Path("/sys/fs/cgroup/pids")
            / Path(
                next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":pids:" in line).split(
                    ":"
                )[2]
            ).relative_to("/")
            / "sandbox-middleware"
        )
        assert int((parent / "pids.max").read_text()) * 128 <= file_max() // 4
    report = local.mechanisms["open files"]
    assert report.startswith("RLIMIT_NOFILE 128 per process")


@pytest.mark.requires_bwrap  # LocalProvider's default isolation, in a subprocess
def test_open_files_stop_at_the_limit_unprivileged(sandbox_base: Path) -> None:
    """As an unprivileged user (no cgroups, no tmpfs): RLIMIT_NOFILE and RLIMIT_NPROC (per uid) bound
    them; the host's open-file count grows by at most what those allow."""
    report = run_unprivileged(
        """
import anyio, json, sys
from sandbox_middleware import LocalProvider, SandboxSpec
from tests.sandbox.providers.local.containment.test_host_pools import _fill_file_table

async def main():
    local = LocalProvider(base_dir=sys.argv[1], nofile=128, pids=64)
    counts, grown = await _fill_file_table(local, 4)
    print(json.dumps({"counts": counts, "grown": grown, "mechanism": local.mechanisms["open files"]}))
    await local.aclose()

anyio.run(main)
""",
        sandbox_base,
    )
    assert all(count <= 128 and errno == 24 for count, errno in report["counts"]), report
    assert "RLIMIT_NPROC, per uid" in report["mechanism"]
    assert report["grown"] < file_max() // 4


_PTY = "ls /dev/ptmx /dev/pts 2>&1; python3 -c 'import os; os.openpty(); print(\"opened a pty\")' 2>&1"


@bwrap_only
async def test_no_pty_without_asking(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """A sandbox that asked for no terminal sees no /dev/ptmx and no /dev/pts, so it cannot take the host's ptys."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    result = await local.exec(handle, _PTY)
    assert "opened a pty" not in result.stdout
    assert "/dev/ptmx" in result.stdout and "No such file" in result.stdout
    devices = await local.exec(handle, "ls /dev")
    assert devices.stdout.split() == [
        "fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"
    ]  # fmt: skip
    assert local.mechanisms["pty"] == "none: no /dev/pts, no /dev/ptmx"


@bwrap_only
def test_no_pty_unprivileged(sandbox_base: Path) -> None:
    report = run_unprivileged(
        f"""
import anyio, json, sys
from sandbox_middleware import LocalProvider, SandboxSpec

async def main():
    local = LocalProvider(base_dir=sys.argv[1])
    result = await local.exec(await local.create(SandboxSpec()), {_PTY!r})
    print(json.dumps(result.stdout))
    await local.aclose()

anyio.run(main)
""",
        sandbox_base,
    )
    assert "opened a pty" not in report and "No such file" in report


def _forced_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_uids, "draw", lambda: _uids.UID_BASE + 7)


def _owner(handle: object) -> int:
    return Path(handle.raw["root"]).stat().st_uid  # type: ignore[attr-defined]


@bwrap_only
@as_root
async def test_sandboxes_never_share_a_uid(
    make: Callable[..., LocalProvider], sandbox_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the random draw forced to repeat, live sandboxes still get distinct uids, and a closed
    sandbox's uid is free again; one sandbox taking its uid's every inotify instance leaves the other its own."""
    _forced_draw(monkeypatch)
    local = make(isolation="bwrap", base_dir=sandbox_base, prestart=False)  # no spare drawing uids meanwhile
    first, second = await local.create(SandboxSpec()), await local.create(SandboxSpec())
    assert _owner(first) == _uids.UID_BASE + 7 and _owner(second) == _uids.UID_BASE + 8
    grab = (
        "python3 -c 'import ctypes, time\nlibc = ctypes.CDLL(None)\nfds = []\n"
        "while libc.inotify_init() >= 0: fds.append(1)\nprint(len(fds), flush=True)\ntime.sleep(30)' &"
        " sleep 1"
    )
    await local.exec(first, f"{{ {grab}; }} > out 2>&1")
    taken = await local.exec(first, "cat out")
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    assert int(taken.stdout) == limit  # the first took every instance its uid may have
    other = await local.exec(second, "python3 -c 'import ctypes; print(ctypes.CDLL(None).inotify_init() >= 0)'")
    assert other.stdout == "True\n"
    await local.close(first)
    third = await local.create(SandboxSpec())
    assert _owner(third) == _uids.UID_BASE + 7  # released at close
    await local.aclose()
    assert not (_uids.LEASES / str(_uids.UID_BASE + 7)).exists()


_HOLDER = """
import anyio, json, sys
from pathlib import Path
from sandbox_middleware import LocalProvider, SandboxSpec
from sandbox_middleware.providers._common import _uids

_uids.draw = lambda: _uids.UID_BASE + 7  # every process draws the same uid first

async def main():
    local = LocalProvider(base_dir=sys.argv[1], prestart=False)  # no spare drawing uids meanwhile
    handles = [await local.create(SandboxSpec(resources={"memory_mib": 64})) for _ in range(2)]
    print(json.dumps([Path(h.raw["root"]).stat().st_uid for h in handles]), flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # hold them until told
    await local.aclose()

anyio.run(main)
"""


@bwrap_only
@as_root
async def test_sandboxes_of_two_processes_never_share_a_uid(sandbox_base: Path) -> None:
    """Two trainer processes whose draws repeat exactly: their four live sandboxes have four uids."""
    sandbox_base.mkdir(parents=True)
    holders = [
        await anyio.open_process([sys.executable, "-c", _HOLDER, str(sandbox_base / name)], stderr=None)
        for name in ("a", "b")
    ]
    uids: list[int] = []
    try:
        for process in holders:  # both hold their sandboxes now
            assert process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive()
            uids += json.loads(line)
    finally:
        for process in holders:  # then both close them
            assert process.stdin is not None
            await process.stdin.send(b"\n")
            with anyio.fail_after(60):
                assert await process.wait() == 0
            await process.aclose()
    assert len(set(uids)) == 4, uids
    assert set(uids) <= set(range(_uids.UID_BASE + 7, _uids.UID_BASE + 11))


def test_unprivileged_mechanisms_say_what_is_not_bounded(sandbox_base: Path) -> None:
    """As a normal user there are no cgroups and no tmpfs: the sandbox writes to disk (so its files
    cost no RAM), and ``mechanisms`` says there is no memory budget and no TCP limit rather than
    claiming them; sandboxes share the user's uid, and a command can lower its oom_score_adj only
    back to the trainer's."""
    report = run_unprivileged(
        """
import anyio, json, os, sys
from pathlib import Path
from sandbox_middleware import LocalProvider, SandboxSpec

async def main():
    local = LocalProvider(isolation="none", base_dir=sys.argv[1])
    handle = await local.create(SandboxSpec())
    oom = await local.exec(handle, "cat /proc/self/oom_score_adj; echo -5 > /proc/self/oom_score_adj || echo refused")
    print(json.dumps({"mechanisms": local.mechanisms, "owner": Path(handle.raw["root"]).stat().st_uid,
                      "me": os.getuid(), "oom": oom.stdout}))
    await local.aclose()

anyio.run(main)
""",
        sandbox_base,
    )
    mechanisms = report["mechanisms"]
    assert mechanisms["memory budget"].startswith("none (no memory cgroup)")
    assert mechanisms["tcp buffers"] == "not limited"
    assert mechanisms["disk"] == "rlimit RLIMIT_FSIZE (per file)"
    assert report["owner"] == report["me"]
    assert report["oom"].split() == ["1000", "refused"]
