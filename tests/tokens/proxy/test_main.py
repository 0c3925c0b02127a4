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

from tests.without_modules import env_without
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


def test_without_the_proxy_extra_it_is_one_line_naming_it(tmp_path: Path) -> None:
    """Without starlette or uvicorn, `python -m tokens.proxy` (even `--help`) is one line naming the extra and
    its install command, exit 2 (it was the traceback of `No module named 'starlette'`); an import of the
    package is an ImportError saying the same."""
    needs = (
        "tokens.proxy needs the 'proxy' extra (starlette is not installed): pip install 'llm-sandbox-middleware[proxy]'"
    )
    env = env_without(tmp_path, "starlette")
    for argv in (["--help"], ["--upstream", "http://h/v1"]):
        done = subprocess.run([sys.executable, "-m", "tokens.proxy", *argv], capture_output=True, text=True, env=env)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"python -m tokens.proxy: {needs}\n")
    imported = subprocess.run([sys.executable, "-c", "import tokens.proxy"], capture_output=True, text=True, env=env)
    assert imported.returncode == 1 and imported.stderr.strip().endswith(f"ImportError: {needs}")
    uvicorn = subprocess.run(
        [sys.executable, "-m", "tokens.proxy", "--help"],
        capture_output=True,
        text=True,
        env=env_without(tmp_path / "u", "uvicorn"),
    )
    assert uvicorn.returncode == 2 and "(uvicorn is not installed)" in uvicorn.stderr


def test_a_postgres_store_without_the_postgres_extra_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokens.proxy", "--upstream", "http://h/v1", "--store", "postgresql://u@127.0.0.1/db"],
        capture_output=True,
        text=True,
        env=env_without(tmp_path, "psycopg"),
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("tokens.proxy: --store: ") and "needs psycopg 3" in done.stderr
    assert "pip install 'llm-sandbox-middleware[postgres]'" in done.stderr


def test_help_is_plain_text_and_every_option_says_what_it_does() -> None:
    from tokens.proxy.__main__ import _parser

    parser = _parser()
    assert "`" not in parser.format_help()
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]
