"""``python -m tokens.proxy``: prints its URL once it listens, serves, and names no upstream in its errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tokens.proxy import ProxyServer, create_app


def test_the_command_prints_its_url_and_serves(tmp_path: Path) -> None:
    with socket.socket() as closed:  # an upstream port where nothing listens
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {**os.environ, "UPSTREAM_KEY": "sk-secret"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokens.proxy",
            "--upstream",
            f"http://127.0.0.1:{port}/v1",
            "--port",
            "0",
            "--upstream-api-key-env",
            "UPSTREAM_KEY",
            "--store",
            f"sqlite:///{tmp_path / 'records.db'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        answer = httpx.post(
            url + "/r/r1/v1/messages",
            json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
        )
        assert answer.status_code == 502 and answer.json()["error"]["type"] == "api_error"
        assert str(port) not in answer.text and "sk-secret" not in answer.text
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0 and str(port) not in err and "sk-secret" not in err
    assert (tmp_path / "records.db").exists()


def test_bad_options_are_one_line_and_exit_2() -> None:
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokens.proxy",
            "--upstream",
            "http://h/v1",
            "--upstream-api-key-env",
            "NO_SUCH_VARIABLE_SET",
        ],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "NO_SUCH_VARIABLE_SET is not set" in missing.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "tokens.proxy", "--upstream", "http://h/v1", "--upstream-timeout", "-1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "upstream_timeout" in bad.stderr
    scheme = subprocess.run(
        [sys.executable, "-m", "tokens.proxy", "--upstream", "ftp://x", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scheme.returncode == 2 and "must be an http(s) URL with a host" in scheme.stderr
    port = subprocess.run(  # it was OverflowError's traceback from bind()
        [sys.executable, "-m", "tokens.proxy", "--upstream", "http://h/v1", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert port.returncode == 2 and "70000 is not a TCP port" in port.stderr and "Traceback" not in port.stderr


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    """It gave uvicorn's log line and two tracebacks (SystemExit from inside its startup), exit 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tokens.proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            ProxyServer(create_app("http://127.0.0.1:9/v1"), port=port).__enter__()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        f"tokens.proxy: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port "
        "(0: any free one) or --host"
    )
