"""A private ``dockerd`` for the tests that kill one: its own data root, exec root, pid file and socket,
no bridge and no iptables, in a network namespace of its own, so nothing it does touches the
machine's own daemon. The namespace matters: a dockerd started with ``--bridge=none`` deletes the
host's ``docker0`` interface (Docker's ``removeDefaultBridgeInterface``), which the machine's daemon needs."""

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

from sandbox_middleware.providers.docker._daemons import identity_of
from sandbox_middleware.providers.docker._files import root_of

from ._support import build_failure, free_claims

__all__ = ["PrivateDaemon", "private_daemon"]


class PrivateDaemon:
    def __init__(self, root: Path, remap: str | None = None) -> None:
        self.root = root
        self.remap = remap  # --userns-remap's USER:GROUP
        self.socket = str(root / "docker.sock")
        self.process: subprocess.Popen[bytes] | None = None
        self.files: Path | None = None  # its sandboxes' work directories on the host (``_files.root_of``)
        self._log = open(root / "dockerd.log", "ab")  # noqa: SIM115 - closed in stop()

    def start(self) -> None:
        namespace = self.root.name.replace("_", "0")  # containerd's names: no "_" beside a "-"
        argv = [
            "unshare", "--net", shutil.which("dockerd") or "dockerd", "--data-root", str(self.root / "data"),
            "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "docker.pid"),
            "-H", f"unix://{self.socket}", "--bridge=none", "--iptables=false", "--ip-masq=false",
            "--storage-driver=vfs", "--containerd-namespace", f"sm-test-{namespace}",
            "--containerd-plugins-namespace", f"sm-test-{namespace}-plugins",
        ]  # fmt: skip
        if self.remap is not None:
            argv.append(f"--userns-remap={self.remap}")
            self.root.chmod(0o711)  # the remapped root must reach its data root below it
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=self._log, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), timeout=2) as client:
                    if client.get("http://docker/_ping").status_code == 200:
                        self.files = root_of(identity_of(client.get("http://docker/info").json(), self.socket))
                        return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"private dockerd did not start: {(self.root / 'dockerd.log').read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the daemon and the containerd it runs (its process group), as a crash of the daemon
        would; the containers' shims live on, as they do then."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        # The killed containerd stays a zombie where nothing reaps orphans (no init here); the pid file
        # naming it would make the restarted dockerd wait for it forever.
        (self.root / "exec" / "containerd" / "containerd.pid").unlink(missing_ok=True)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # whatever of ours still runs (a containerd, shims, container processes): by its command line
        for _ in range(3):
            for pid in _ours(str(self.root)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        # its own mounts, and what its sandboxes left in their work directories, their containers gone with it
        for mount in reversed([*_mounts(str(self.root)), *(_mounts(f"{self.files}/") if self.files else [])]):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        if self.files is not None:
            shutil.rmtree(self.files, ignore_errors=True)
        self._log.close()


def _ours(root: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if root.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _mounts(root: str) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(root)
    ]


@contextlib.contextmanager
def private_daemon(remap: str | None = None) -> Iterator[PrivateDaemon]:
    """A started private daemon holding the busybox test image (``remap``: with ``--userns-remap``);
    stopped and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="dockerd-", dir="/var/tmp"))
    daemon = PrivateDaemon(root, remap)
    try:
        daemon.start()
        env = {**os.environ, "DOCKER_HOST": f"unix://{daemon.socket}"}
        if (failure := build_failure("busybox", env=env)) is not None:
            raise RuntimeError(f"the private dockerd has no test image: {failure}")
        yield daemon
    finally:
        daemon.stop()
        free_claims(daemon.socket, daemon_gone=True)  # its containers ended with it
        shutil.rmtree(root, ignore_errors=True)
