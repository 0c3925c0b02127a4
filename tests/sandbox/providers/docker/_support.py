"""What the Docker provider's tests need: a daemon (skipped with one line where there is none; failed
with REQUIRE_DOCKER=1; ``DOCKER_HOST=unix://PATH`` names another, Podman's say, as it does for the
provider), the OCI runtime their sandboxes run under (``SANDBOX_DOCKER_RUNTIME``, e.g. ``runsc``),
the test images (built by scripts/build-docker-images.sh when missing, never pulled), and the removal
of every container and snapshot image a test session made (by its label), even after a failure."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from sandbox_middleware import DockerProvider, SandboxSpec
from sandbox_middleware.providers._common import _uids
from sandbox_middleware.providers.docker._files import ROOT
from sandbox_middleware.providers.docker._ttl import SPARE
from sandbox_middleware.providers.local._records import remove_box
from sandbox_middleware.providers.local._snapshots import SNAPSHOT_RECORD
from tests.needs import unavailable

SOCKET = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
"""The daemon under test: ``DOCKER_HOST``, as ``DockerProvider()`` reads it."""
RUNTIME = os.environ.get("SANDBOX_DOCKER_RUNTIME") or None
"""The runtime the tests' sandboxes run under (``SANDBOX_DOCKER_RUNTIME=runsc``: gVisor); unset, the daemon's."""
BUSYBOX = "sandbox-middleware/busybox:test"
PYTHON = "sandbox-middleware/python:test"
IMAGES = (BUSYBOX, PYTHON)
REQUIRE = "REQUIRE_DOCKER"
INSTALL = "apt-get install docker.io, then start dockerd"
BRIDGE = "start dockerd with its default bridge (no --bridge=none) for the tests that publish a port"
SESSION_KEY = "tests.session"
SESSION = uuid.uuid4().hex[:12]
"""Every container of this test session carries ``spec.metadata[SESSION_KEY] = SESSION``."""
SESSION_LABEL = f"sandbox_middleware.docker.meta.{SESSION_KEY}={SESSION}"
TAG = "tests.spare"  # a metadata key of the spares' tests: each test's own value, its containers found by it
BUILD = Path(__file__).resolve().parents[4] / "scripts" / "build-docker-images.sh"


def engine(socket: str = SOCKET) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=socket), base_url="http://docker/v1.41", timeout=60)


def options() -> dict[str, Any]:
    """``DockerProvider`` options of the daemon and runtime under test."""
    return {"socket": SOCKET, "runtime": RUNTIME}


@functools.cache
def engine_kind() -> str:
    """``"podman"`` or ``"docker"``: the daemon under test (Podman's ``/info`` carries ``BuildahVersion``)."""
    with engine() as client:
        return "podman" if "BuildahVersion" in client.get("/info").json() else "docker"


def cannot_hold(under: str, reason: str) -> None:
    """Skip the calling test where the daemon under test is ``under`` (``"podman"``) or its sandboxes' runtime is
    (``"runsc"``): what it asserts does not hold there, for ``reason`` (docs/gvisor.md, docs/docker-provider.md)."""
    if under in (RUNTIME, engine_kind()):
        pytest.skip(f"cannot hold under {under}: {reason}")


def require_runsc() -> None:
    """Skip (REQUIRE_RUNSC=1: fail) the calling test where the daemon under test has no ``runsc`` runtime."""
    require_docker()
    if engine_kind() == "podman":
        pytest.skip("Podman's Docker-compatible API ignores a container's runtime (test_podman.py: refused)")
    with engine() as client:
        if "runsc" not in (client.get("/info").json().get("Runtimes") or {}):
            unavailable(
                f"the daemon at {SOCKET} has no runsc runtime (gVisor): apt-get install runsc, then register it in "
                "/etc/docker/daemon.json (docs/gvisor.md) and restart dockerd",
                "REQUIRE_RUNSC",
            )


def docker_problem(socket: str = SOCKET) -> str | None:
    """Why the Docker tests cannot run here (the skip reason), or None."""
    if not (os.path.exists(socket) and stat.S_ISSOCK(os.stat(socket).st_mode)):
        return f"Docker is not running here (no daemon socket {socket}): {INSTALL}"
    try:
        with engine(socket) as client:
            client.get("/_ping").raise_for_status()
    except httpx.HTTPError as exc:
        return f"the Docker daemon at {socket} does not answer ({exc}): {INSTALL}"
    return None


def require_docker() -> None:
    """Skip the calling test for want of a daemon (or of what builds the test images), in one line; with
    REQUIRE_DOCKER=1 fail it instead. Where the images' build fails, fail with what the script said."""
    problem = docker_problem()
    if problem is None:
        problem, failure = _images()
        if failure is not None:
            pytest.fail(failure, pytrace=False)
    if problem is not None:
        unavailable(problem, REQUIRE)


def require_bridge() -> None:
    """A test that publishes a port (``network="bridge"``) needs the daemon's default bridge network, which
    a daemon started with ``--bridge=none`` (common on CI hosts) has not: skipped in one line there."""
    require_docker()
    with engine() as client:
        if client.get("/networks/bridge").status_code == 404:
            unavailable(
                f"the Docker daemon at {SOCKET} has no bridge network (dockerd --bridge=none): {BRIDGE}", REQUIRE
            )


@functools.cache
def _images() -> tuple[str | None, str | None]:
    """Build the test images that are missing, once a session: why they cannot be built here (a skip
    reason), and what the build script said if it failed."""
    with engine() as client:
        missing = [image for image in IMAGES if client.get(f"/images/{image}/json").status_code == 404]
    if not missing:
        return None, None
    if shutil.which("docker") is None:
        return f"the docker CLI (which builds the test images) is not installed: {INSTALL}", None
    if not os.path.exists(os.environ.get("BUSYBOX", "/bin/busybox")):
        return "busybox-static (the images are built from it) is not installed: apt-get install busybox-static", None
    return None, build_failure()


def build_failure(*names: str, env: Mapping[str, str] | None = None) -> str | None:
    """Run scripts/build-docker-images.sh for ``names`` (default all); where it fails, what it said."""
    done = subprocess.run(["bash", str(BUILD), *names], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode == 0:
        return None
    said = (done.stderr + done.stdout).strip()[-3000:] or "(nothing on stdout or stderr)"
    return f"scripts/{BUILD.name} failed (exit {done.returncode}):\n{said}"


def _labelled(kind: str, label: str, socket: str) -> list[str]:
    """Ids of the ``kind`` (``containers``, running or not, or ``images``) carrying ``label`` (``key=value``)."""
    with engine(socket) as client:
        reply = client.get(f"/{kind}/json", params={"all": "1", "filters": json.dumps({"label": [label]})})
        reply.raise_for_status()
        return [str(found["Id"]) for found in reply.json()]


def _removed(kind: str, label: str, socket: str, params: Mapping[str, str]) -> list[str]:
    found = _labelled(kind, label, socket)
    with engine(socket) as client:
        for thing in found:
            client.delete(f"/{kind}/{thing}", params=params)
    return found


def containers(label: str = SESSION_LABEL, socket: str = SOCKET) -> list[str]:
    """Ids of the containers (running or not) carrying ``label`` (``key=value``)."""
    return _labelled("containers", label, socket)


def remove_containers(label: str = SESSION_LABEL, socket: str = SOCKET) -> list[str]:
    """Force-remove (with their volumes) the containers carrying ``label``; returns their ids."""
    return _removed("containers", label, socket, {"force": "1", "v": "1"})


def images(label: str = SESSION_LABEL, socket: str = SOCKET) -> list[str]:
    """Ids of the images carrying ``label`` (``key=value``): snapshots (whose metadata the label is)."""
    return _labelled("images", label, socket)


def remove_images(label: str = SESSION_LABEL, socket: str = SOCKET) -> list[str]:
    """Force-remove the images carrying ``label`` (never their parents); returns their ids."""
    return _removed("images", label, socket, {"force": "1", "noprune": "1"})


def remove_host_snapshots() -> list[Path]:
    """Remove the snapshots without a copy (``_files.py``: records on the host) of this session; returns them."""
    found = []
    for record in ROOT.glob(f"*/snap-*/{SNAPSHOT_RECORD}"):
        with contextlib.suppress(OSError, ValueError):
            if json.loads(record.read_text()).get("metadata", {}).get(SESSION_KEY) == SESSION:
                found.append(record.parent)
                remove_box(record.parent, False, [])
    return found


def free_claims(socket: str = SOCKET, *, daemon_gone: bool = False) -> list[int]:
    """Free the uid leases claimed for containers of ``socket`` that are gone (removed behind their
    provider's back: by a test, the TTL watchdog; ``daemon_gone``: all of them, its daemon stopped with
    its containers): what a later create would free lazily; returns the uids."""
    directory = _uids.lease_directory()
    freed = []
    with engine(socket) as client:
        for path in directory.glob("[0-9]*") if directory.is_dir() else ():
            try:
                claim = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue  # a LocalProvider lease (its maker's pid), or gone meanwhile
            if not isinstance(claim, dict) or claim.get("socket") != socket:
                continue
            if daemon_gone or client.get(f"/containers/{claim.get('container')}/json").status_code == 404:
                _uids.release_claim(directory, int(path.name), socket, (str(claim["container"]),))
                freed.append(int(path.name))
    return freed


def claim_of(uid: int) -> str | None:
    """The container (id or name) the lease of host uid ``uid`` is claimed for; None: free (or a
    LocalProvider lease)."""
    try:
        claim = json.loads((_uids.lease_directory() / str(uid)).read_bytes())
    except (OSError, ValueError):
        return None
    return str(claim.get("container")) if isinstance(claim, dict) else None


def memory_cgroup(container: str) -> Path:
    """The container's v1 memory cgroup on the host (through its init's /proc entry)."""
    with engine() as client:
        pid = client.get(f"/containers/{container}/json").json()["State"]["Pid"]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise AssertionError(f"container {container[:12]} has no v1 memory cgroup")


def spec(image: str = BUSYBOX, metadata: Mapping[str, str] | None = None, **fields: Any) -> SandboxSpec:
    """A spec of this test session (its label lets the session remove whatever a test leaves)."""
    return SandboxSpec(image=image, metadata={SESSION_KEY: SESSION, **(metadata or {})}, **fields)


def on_daemon(tag: str) -> list[dict[str, Any]]:
    """The containers (running or not) of this session whose metadata has ``TAG=tag``, as the daemon lists them."""
    labels = [f"sandbox_middleware.docker.meta.{SESSION_KEY}={SESSION}", f"sandbox_middleware.docker.meta.{TAG}={tag}"]
    with engine() as client:
        reply = client.get("/containers/json", params={"all": "1", "filters": json.dumps({"label": labels})})
        reply.raise_for_status()
        return list(reply.json())


def spares_on_daemon(tag: str) -> list[dict[str, Any]]:
    """Those of them that are untaken spares (their name ends in -spare)."""
    return [c for c in on_daemon(tag) if SPARE in (c.get("Labels") or {}) and c["Names"][0].endswith("-spare")]


async def one_spare(tag: str, timeout_s: float = 60.0, kept_by: DockerProvider | None = None) -> dict[str, Any]:
    """The single running spare of ``tag``, waited for: a spare is made in the background after a create;
    with ``kept_by``, until that provider keeps it too (after its start, its TCP bound and an inspect: a
    while later against Podman), so that its next create takes it."""
    with anyio.fail_after(timeout_s):
        while True:
            found = spares_on_daemon(tag)
            if len(found) == 1 and found[0]["State"] == "running":
                break
            await anyio.sleep(0.05)
    spares = None if kept_by is None else kept_by._spares
    assert spares is None or await anyio.to_thread.run_sync(spares.wait, timeout_s), "the spare is not kept"
    return found[0]


def tagged(tag: str, **fields: Any) -> SandboxSpec:
    """A spec of this session whose metadata has ``TAG=tag`` (and ``fields``)."""
    return spec(metadata={TAG: tag, **fields.pop("metadata", {})}, **fields)
