"""A private ``podman system service`` for the tests that prove DockerProvider against Podman's Docker-compatible
API: its own storage root, run root, socket and ``containers.conf`` in a temp directory, stopped and removed
afterwards (its overlay mounts, and the ``conmon`` each exec leaves sleeping ``exit_command_delay``, too).
Skipped in one line where Podman is absent; ``REQUIRE_PODMAN=1`` turns that into a failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.needs import unavailable

from ._daemon import _mounts, _ours
from ._support import build_failure

__all__ = ["private_podman"]

INSTALL = "apt-get install podman catatonit"


@contextlib.contextmanager
def private_podman() -> Iterator[str]:
    """The socket of a started private Podman service holding the busybox test image."""
    podman = shutil.which("podman")
    if podman is None:
        unavailable(f"Podman is not installed: {INSTALL}", "REQUIRE_PODMAN")
    root = Path(tempfile.mkdtemp(prefix="podman-", dir="/var/tmp"))
    socket = root / "podman.sock"
    flags = ["--root", str(root / "storage"), "--runroot", str(root / "run")]
    # Podman keeps each exec's conmon for exit_command_delay (300 s, "as Docker keeps an exec's inspect"):
    # the provider reads an exec's exit code within a second of its end.
    (root / "containers.conf").write_text(
        f'[engine]\nexit_command_delay = 5\ntmp_dir = "{root / "libpod"}"\n'
        f'[network]\nnetwork_config_dir = "{root / "networks"}"\n'
    )
    (root / "tmp").mkdir()  # the service's temp files (an import's upload, api_load.tar*) go with the directory
    env = {**os.environ, "CONTAINERS_CONF": str(root / "containers.conf"), "TMPDIR": str(root / "tmp")}
    log = open(root / "service.log", "ab")  # noqa: SIM115 - closed below
    service = subprocess.Popen(
        [podman, *flags, "system", "service", "--time=0", f"unix://{socket}"],
        stdout=log, stderr=log, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _answers(str(socket)):
            if service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"podman system service did not start: {(root / 'service.log').read_text()[-2000:]}")
            time.sleep(0.2)
        if (failure := build_failure("busybox", env={**os.environ, "DOCKER_HOST": f"unix://{socket}"})) is not None:
            raise RuntimeError(f"the private Podman service has no test image: {failure}")
        yield str(socket)
    finally:
        subprocess.run(
            [podman, *flags, "rm", "--all", "--force", "--time", "0"], env=env, capture_output=True, timeout=120
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGTERM)
        try:
            service.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait()
        log.close()
        for pid in _ours(str(root)):  # exec conmons still sleeping out their delay, then running a cleanup
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mount in reversed(_mounts(str(root))):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _answers(socket: str) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket), timeout=5) as client:
            return client.get("http://d/_ping").status_code == 200
    except httpx.HTTPError:
        return False
