"""DockerProvider against a private Podman service's Docker-compatible socket: the cycle (create, exec,
transfers, close), labels, list and reap. The whole Docker suite runs against Podman too
(``DOCKER_HOST=unix://...podman.sock``, a ``.ci/run`` step); this file proves the core in every run."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandbox_middleware import (
    DockerProvider,
    DockerRuntimeNotFoundError,
    Middleware,
    OwnershipMiddleware,
    SandboxArgumentError,
    SandboxNotFoundError,
    reap,
    stack,
)
from sandbox_middleware.providers._common import _uids
from tests.providers import crashed_worker

from ._podman import private_podman
from ._support import BUSYBOX, SESSION, SESSION_KEY, spec

pytestmark = pytest.mark.anyio

_WORKER = """
import sys, anyio
from sandbox_middleware import DockerProvider, Middleware, OwnershipMiddleware, SandboxSpec, stack
async def main():
    provider = stack(DockerProvider(socket=sys.argv[1]), [Middleware(OwnershipMiddleware, run_id="podman-run")])
    for _ in range(3):  # tests.providers.crashed_worker reads three ids
        handle = await provider.create(SandboxSpec(image=sys.argv[2], metadata={sys.argv[3]: sys.argv[4]}))
        print(handle.sandbox_id, flush=True)
    await anyio.sleep(3600)
anyio.run(main)
"""


@pytest.fixture(scope="module")
def podman_socket() -> Iterator[str]:
    with private_podman() as socket:
        yield socket


@pytest.fixture
async def podman(podman_socket: str) -> AsyncIterator[DockerProvider]:
    provider = DockerProvider(socket=podman_socket)
    yield provider
    await provider.aclose()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the runtime is under test here, not the event loop


async def test_the_cycle_against_podman(podman: DockerProvider, tmp_path: Path) -> None:
    """Create, exec, transfers both ways, close; the writable directories are bounded tmpfs owned by the
    sandbox's user (Podman ignored the volumes' tmpfs options: they were on the host's disk, unbounded)."""
    handle = await podman.create(spec(files={"in.txt": "payload"}, env={"E": "1"}))
    result = await podman.exec(handle, "id -u; echo $E; tr a-z A-Z < in.txt > out.txt; echo done >&2; exit 3")
    uid = int(result.stdout.split()[0])  # a host uid of its own, leased as under Docker
    assert _uids.UID_BASE <= uid < _uids.UID_BASE + _uids.UID_COUNT, result
    assert (result.stdout, result.stderr, result.return_code, result.error_type) == (f"{uid}\n1\n", "done\n", 3, None)
    mounts = (await podman.exec(handle, "grep -E ' /(workspace|tmp) ' /proc/mounts")).stdout.splitlines()
    assert sorted(line.split()[:3] for line in mounts) == [
        ["tmpfs", "/tmp", "tmpfs"], ["tmpfs", "/workspace", "tmpfs"],
    ], mounts  # fmt: skip
    assert all("size=" in line and f"uid={uid}" in line for line in mounts), mounts
    full = await podman.exec(handle, "dd if=/dev/zero of=/tmp/big bs=1M count=600")
    assert full.return_code != 0 and "No space left" in full.stderr  # tmp_mib=512
    (tmp_path / "up.bin").write_bytes(b"\x00\x01" * 5000)
    await podman.upload_file(handle, tmp_path / "up.bin", "deep/up.bin")
    assert (await podman.exec(handle, "stat -c '%u %s' deep/up.bin")).stdout == f"{uid} 10000\n"
    await podman.download_file(handle, "out.txt", tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "PAYLOAD"
    timed_out = await podman.exec(handle, "sleep 60 & sleep 61", timeout_s=1)
    assert timed_out.error_type == "timeout"
    assert "sleep 6" not in (await podman.exec(handle, "ps -o args")).stdout  # killed from the host (top's hpid)
    await podman.close(handle)
    with pytest.raises(SandboxNotFoundError):
        await podman.exec(handle, "true")


async def test_labels_list_and_reap_against_podman(podman: DockerProvider, podman_socket: str) -> None:
    """A killed worker's sandboxes are listed by label and reaped; a live one's and another run's are not."""
    crashed = await crashed_worker([sys.executable, "-c", _WORKER, podman_socket, BUSYBOX, SESSION_KEY, SESSION])
    mine = await stack(podman, [Middleware(OwnershipMiddleware, run_id="podman-run")]).create(spec())
    other = await podman.create(spec(metadata={"role": "other"}))
    listed = {listing.handle.sandbox_id for listing in await podman.list(metadata={SESSION_KEY: SESSION})}
    assert listed == crashed | {mine.sandbox_id, other.sandbox_id}
    [role] = await podman.list(metadata={SESSION_KEY: SESSION, "role": "other"})
    assert role.handle.sandbox_id == other.sandbox_id and role.created_at is not None
    reaped = await reap(podman, run_id="podman-run")
    assert {entry.sandbox_id for entry in reaped} == crashed and all(entry.closed for entry in reaped)
    left = {listing.handle.sandbox_id for listing in await podman.list(metadata={SESSION_KEY: SESSION})}
    assert left == {mine.sandbox_id, other.sandbox_id}
    await podman.close(mine)
    await podman.close(other)


async def test_a_runtime_podman_would_ignore_is_refused(podman_socket: str) -> None:
    """Podman's Docker-compatible API takes HostConfig.Runtime and runs the container under its default all the
    same (runsc asked, the host's kernel answered): asking for another runtime is a typed error, not a lie."""
    with pytest.raises(DockerRuntimeNotFoundError, match=r"ignores a container's runtime .*containers\.conf"):
        DockerProvider(socket=podman_socket, runtime="runsc")
    await DockerProvider(socket=podman_socket, runtime="runc").aclose()  # its default: nothing to ignore


async def test_ptys_podman_cannot_mount_are_refused(podman_socket: str) -> None:
    """Podman's Docker-compatible API ignores the devpts volume's options (no pty opened): ptys > 0 is refused."""
    with pytest.raises(SandboxArgumentError, match=r"ptys=4 .*Podman service .*ptys=0"):
        DockerProvider(socket=podman_socket, ptys=4)
