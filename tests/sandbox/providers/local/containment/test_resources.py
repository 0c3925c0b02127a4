"""Resource exhaustion: output floods, memory, fork bombs, disk, the trainer's descriptors, and limits that cannot be
enforced."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import LocalProvider, SandboxLimitError, SandboxSpec
from tests.leftovers import sandbox_dirs

from ._support import as_root

pytestmark = pytest.mark.anyio


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
    assert sandbox_dirs(sandbox_base) == []
    handle = await local.create(SandboxSpec(resources={"memory_mib": 64}))
    result = await local.exec(handle, "python3 -c 'x = bytearray(512 << 20); print(\"allocated\")'")
    assert "allocated" not in result.stdout
    await local.aclose()


def test_cgroup_v2_layout(tmp_path: Path) -> None:
    """On a cgroup v2 machine the same limits land in v2's files (checked on a v2-shaped directory:
    this machine's controllers are all on v1, so the real v2 path cannot run here)."""
    from sandbox_middleware.providers._common._limits import Limits
    from sandbox_middleware.providers.local._cgroups import CgroupBackend

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


_DESCRIPTORS = """
import anyio, json, os, resource, sys
from sandbox_middleware import LocalProvider, SandboxError, SandboxSpec

async def main():
    # No spare: one made in the background would open descriptors while they are counted here.
    local = LocalProvider(isolation=sys.argv[1], base_dir=sys.argv[2], prestart=False)
    handle = await local.create(SandboxSpec())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    outcomes = []
    for room in range(12):  # every point where exec opens a descriptor: pipes, memfds, the process
        before = sorted(os.listdir("/proc/self/fd"))
        fillers = []
        try:  # take every free descriptor, then give back exactly `room` of them
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for fd in fillers[len(fillers) - room :]:
            os.close(fd)
        try:
            result = await local.exec(handle, "echo ok")
            outcomes.append(result.stdout)
        except SandboxError as exc:
            outcomes.append(type(exc).__name__)
        finally:
            for fd in fillers[: len(fillers) - room]:
                os.close(fd)
        assert sorted(os.listdir("/proc/self/fd")) == before, (room, before)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await local.aclose()
    print(json.dumps(outcomes))

anyio.run(main)
"""


async def test_exec_at_the_descriptor_limit_is_a_typed_error_and_leaks_nothing(
    isolation: str, sandbox_base: Path
) -> None:
    """With the trainer at its open-file limit, exec raises SandboxError (never a bare OSError) and
    leaves no pipe or memfd open, at every point it could fail; with room it runs."""
    run = await anyio.run_process([sys.executable, "-c", _DESCRIPTORS, isolation, str(sandbox_base)], check=False)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    outcomes = json.loads(run.stdout)
    assert outcomes[0] == "SandboxError" and outcomes[-1] == "ok\n", outcomes
    assert set(outcomes) == {"SandboxError", "ok\n"}, outcomes


def test_memory_budget_from_the_tightest_ancestor_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On cgroup v2 the budget comes from the tightest ancestor (a 1 GiB pod around an unlimited job):
    its limit less what the trainer's processes use without file cache, less the reserve; a create
    beyond what live sandboxes leave of it is refused naming the budget (checked on a v2-shaped
    directory: this machine is v1)."""
    from sandbox_middleware import SandboxLimitError
    from sandbox_middleware.providers._common._limits import Limits
    from sandbox_middleware.providers.local import _cgroups

    monkeypatch.setattr(_cgroups, "_own_cgroups", lambda: {"": "/pod/job"})
    monkeypatch.setattr(_cgroups, "_meminfo", lambda: (64 << 30, 60 << 30))  # the machine is not the tightest
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    pod, job = tmp_path / "pod", tmp_path / "pod" / "job"
    parent = job / "sandbox-middleware"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("memory pids\n")
    (pod / "memory.max").write_text(str(1 << 30))
    (pod / "memory.current").write_text(str(400 << 20))
    (pod / "memory.stat").write_text(f"anon 1\ninactive_file {100 << 20}\n")
    (job / "memory.max").write_text("max\n")
    backend = _cgroups.CgroupBackend(root=tmp_path)
    budget = backend.memory_budget()
    assert budget is not None
    assert (budget.limit, budget.where, budget.reserve) == (1 << 30, str(pod), 256 << 20)
    assert budget.total == (1024 - 300 - 256) << 20
    (group,) = backend.create(
        "local-000000000001", Limits(memory_bytes=400 << 20, pids=None, cpu=None, disk_bytes=None)
    )
    assert (group / "memory.max").read_text() == str(400 << 20)
    assert not (group / "memory.kmem.tcp.limit_in_bytes").exists()  # v2 charges sockets to memory.max
    assert (parent / "memory.max").read_text() == str(budget.total)  # all sandboxes together, kernel-enforced
    (parent / "memory.current").write_text(str(400 << 20))  # the first sandbox now uses its 400 MiB,
    (pod / "memory.current").write_text(str(800 << 20))  # which the pod's usage includes
    with pytest.raises(SandboxLimitError, match=r"memory budget is 468 MiB .* live sandboxes use 400 MiB of it"):
        backend.create("local-000000000002", Limits(memory_bytes=100 << 20, pids=None, cpu=None, disk_bytes=None))
