"""The OCI runtime of DockerProvider's sandboxes (``runtime=``, gVisor's ``runsc``), and the daemon it is found
by (``socket=`` or ``DOCKER_HOST``), on the real daemon."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_middleware import (
    DockerProvider,
    DockerRuntimeNotFoundError,
    DockerUnavailableError,
    SandboxArgumentError,
    SandboxNotFoundError,
    SandboxStatus,
)

from ._support import PYTHON, SOCKET, engine, require_docker, require_runsc, spec

pytestmark = pytest.mark.anyio


async def test_a_runtime_the_daemon_lacks_is_a_typed_error_naming_it_and_the_daemons(
    make: Callable[..., DockerProvider],
) -> None:
    with pytest.raises(DockerRuntimeNotFoundError) as caught:
        make(runtime="no-such-runtime")
    message = str(caught.value)
    assert re.search(r"has no runtime 'no-such-runtime' \(it has: [^)]*\brunc\b", message), message
    assert ("daemon.json" in message or "containers.conf" in message) and "apt-get install runsc" in message
    assert isinstance(caught.value, DockerUnavailableError)  # what callers of construction already catch


async def test_runsc_runs_each_sandbox_on_gvisors_kernel(make: Callable[..., DockerProvider]) -> None:
    """Under runsc a command meets gVisor's user-space kernel, not the host's; the container says its runtime."""
    require_runsc()
    provider = make(runtime="runsc")
    assert "runtime='runsc'" in repr(provider) and "whole sandbox dies" in provider.mechanisms["memory"]
    handle = await provider.create(spec())
    boot = await provider.exec(handle, "dmesg | head -n 1; uname -r")
    assert "Starting gVisor" in boot.stdout and Path("/proc/sys/kernel/osrelease").read_text() not in boot.stdout
    with engine() as client:
        assert client.get(f"/containers/{handle.sandbox_id}/json").json()["HostConfig"]["Runtime"] == "runsc"
    await provider.close(handle)


@pytest.mark.parametrize(
    ("limits", "command", "error_type", "why"),
    [
        # the daemon marks most of these OOM kills, not every one: "oom", else "stopped" with exit 137
        ({"memory_mib": 256}, "python3 -c 'x = bytearray(1 << 30); print(len(x))'", ("oom", "stopped"), "memory limit"),
        ({"pids": 128}, "for i in $(seq 1000); do sleep 60 & done; wait", ("stopped",), "exited"),
    ],
    ids=["memory", "pids"],
)
async def test_under_gvisor_a_limit_kills_the_whole_sandbox_and_says_so(
    make: Callable[..., DockerProvider], limits: dict[str, int], command: str, error_type: tuple[str, ...], why: str
) -> None:
    """gVisor's Sentry runs every process of a sandbox inside the container's cgroup: past the memory limit
    the kernel kills the Sentry, past the pids limit it dies (its threads count), and with it every
    process and file of the sandbox (runc kills only the command: test_memory_limit_holds). The command's
    result says so (error_type, the container's exit code, why on stderr); a later exec is
    SandboxNotFoundError saying why."""
    require_runsc()
    provider = make(runtime="runsc", **limits)
    handle = await provider.create(spec(PYTHON))
    result = await provider.exec(handle, command, timeout_s=120)
    assert result.error_type in error_type and (result.return_code == 137) == ("memory_mib" in limits), result
    assert "the sandbox stopped during the command" in result.stderr and why in result.stderr, result
    assert "under gVisor (runsc) a memory or pids limit kills the whole sandbox" in result.stderr
    with pytest.raises(SandboxNotFoundError, match=f"is not running: .*{why}.*create a new one"):
        await provider.exec(handle, "true")
    assert await provider.status(handle) is SandboxStatus.STOPPED
    await provider.close(handle)


async def test_docker_host_names_the_daemon_when_socket_is_unset(
    make: Callable[..., DockerProvider], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As the docker CLI does (Podman users set it to their socket); socket= wins; a daemon the provider
    cannot speak to (tcp://) is a typed error naming what to do."""
    require_docker()
    link = tmp_path / "daemon.sock"
    link.symlink_to(SOCKET)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{link}")
    provider = DockerProvider()
    assert repr(provider).startswith(f"DockerProvider(socket={str(link)!r}")
    await provider.aclose()
    assert repr(make(socket=SOCKET)).startswith(f"DockerProvider(socket={SOCKET!r}")
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:2375")
    with pytest.raises(DockerUnavailableError, match=re.escape("DOCKER_HOST='tcp://127.0.0.1:2375' is not a unix://")):
        DockerProvider()


async def test_ptys_gvisor_cannot_give_are_refused() -> None:
    """Under runsc a devpts volume is the host's, seen through the Gofer (/dev/ptmx: EINVAL): ptys > 0 is refused."""
    require_runsc()
    with pytest.raises(SandboxArgumentError, match=r"ptys=4 .*gVisor .*ptys=0"):
        DockerProvider(socket=SOCKET, runtime="runsc", ptys=4)
