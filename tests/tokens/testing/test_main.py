"""``python -m tokens.testing.server`` as a user runs it: the URL on one line, a script's replies in order,
Ctrl-C and SIGTERM, ``--help``, and every unusable script or option answered in one line with exit 2."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import ROOT
from tests.served import served

PROGRAM = ["-m", "tokens.testing.server"]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}


def run(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *PROGRAM, *arguments], capture_output=True, text=True, timeout=60, cwd=cwd or ROOT
    )


def test_a_script_and_options_are_served_in_order(tmp_path: Path) -> None:
    """The script file's replies, then the options' in command-line order, then texts of the fake's own."""
    script = {
        "model": "my-model",
        "replies": [
            "It is noon.",
            {"tool_call": {"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}},
            {"token_ids": [75, 107, 2], "logprobs": [-0.5, -0.25, -0.01]},
            {"error": 503, "message": "warming up", "retry_after": 3},
        ],
    }
    (tmp_path / "script.json").write_text(json.dumps(script))
    arguments = [*PROGRAM, "--port", "0", "--script", "script.json", "--error", "429", "--reply", "Bye."]
    with served(arguments, cwd=tmp_path) as url, httpx.Client(base_url=url) as client:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        answers = [client.post("/chat/completions", json={**CHAT, "logprobs": True}) for _ in range(7)]
        assert client.get("/models").json()["data"][0]["id"] == "my-model"
    messages = [answer.json()["choices"][0]["message"] for answer in answers if answer.status_code == 200]
    assert messages[0]["content"] == "It is noon."
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "Europe/Oslo"}'}
    assert messages[2]["content"] == "Hh"
    assert [entry["logprob"] for entry in answers[2].json()["choices"][0]["logprobs"]["content"]] == [
        -0.5,
        -0.25,
        -0.01,
    ]
    assert (answers[3].status_code, answers[3].headers["retry-after"]) == (503, "3")
    assert answers[3].json()["error"]["message"] == "warming up"
    assert answers[4].status_code == 429
    assert messages[3]["content"] == "Bye." and messages[4]["content"] not in {"Bye.", "It is noon."}


@contextlib.contextmanager
def _serving(*options: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The program started with ``options``, and the URL it printed; killed on leaving the block if it
    still runs (a test that failed before stopping it leaves no server behind)."""
    process = subprocess.Popen(
        [sys.executable, *PROGRAM, *options], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_it_with_exit_0(stop: signal.Signals) -> None:
    with (
        _serving("--port", "0", "--stream-delay", "30") as (process, url),
        httpx.Client() as client,
        client.stream("POST", url + "/chat/completions", json={**CHAT, "stream": True}),
    ):
        process.send_signal(stop)  # with a stream under way, 30 s from its next event
        out, err = process.communicate(timeout=30)
    assert (process.returncode, out, err) == (0, "", "")


def test_sigint_stops_it_where_its_starter_ignored_sigint() -> None:
    """Started in the background of a script (``&``: SIGINT ignored, inherited), SIGINT still stops it, exit 0."""
    process = subprocess.Popen(
        [sys.executable, *PROGRAM, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert process.stdout is not None and process.stdout.readline().startswith("http://")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.communicate()


def test_log_prints_one_line_per_request() -> None:
    with _serving("--port", "0", "--log") as (process, url):
        httpx.post(url + "/chat/completions", json=CHAT)
        httpx.get(url + "/nothing")
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    lines = err.splitlines()
    assert process.returncode == 0 and len(lines) == 2, err
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in lines[0] and '"GET /v1/nothing HTTP/1.1" 404' in lines[1]


def test_help_is_clean() -> None:
    done = run("--help")
    assert done.returncode == 0 and done.stderr == ""
    assert "--script FILE" in done.stdout and '"token_ids"' in done.stdout and "``" not in done.stdout


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = run("--port", str(taken.getsockname()[1]))
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "cannot listen on 127.0.0.1:" in line and "pick another --port" in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "script.json: cannot read the script: No such file or directory; give the path of a JSON script"),
        ("{", "script.json: not JSON (Expecting property name enclosed in double quotes: line 1 column 2"),
        ("[]", "script.json: a script is a JSON object (keys 'max_model_len', 'model', 'replies', 'stream_delay_s')"),
        ('{"reply": []}', "script.json: unknown key 'reply'; a script's keys are 'max_model_len', 'model',"),
        ('{"replies": "hi"}', "script.json: replies must be a list of replies, not a string"),
        ('{"replies": [1]}', "script.json: replies[0]: a reply is a text or an object with one of 'error', 'text',"),
        ('{"replies": [{}]}', "script.json: replies[0]: a reply has exactly one of 'error', 'text', 'token_ids', "
                              "'tool_call'; this one has none"),
        ('{"replies": [{"text": "a", "error": 500}]}', "replies[0]: a reply has exactly one of"),
        ('{"replies": [{"text": "a", "logprobs": []}]}', "replies[0]: 'logprobs' is not a key of a text reply"),
        ('{"replies": ["ok", {"token_ids": [75, 400]}]}', "script.json: replies[1]: token_ids[1] is 400, not an id of "
                                                          "the fake's tokenizer: give 0 to 258"),
        ('{"replies": [{"token_ids": [75], "logprobs": [0.5]}]}', "logprobs[0] is 0.5; a log probability is at most 0"),
        ('{"replies": [{"token_ids": [75], "logprobs": []}]}', "logprobs must be a list of 1 numbers, one per token"),
        ('{"replies": [{"token_ids": [75], "logprobs": [-Infinity]}]}', "logprobs[0] must be a finite number"),
        ('{"replies": [{"error": 200}]}', "replies[0]: error must be an HTTP status from 400 to 599, not 200"),
        ('{"replies": [{"error": 503, "retry_after": -1}]}', "retry_after must be a number of at least 0, not -1"),
        ('{"replies": [{"tool_call": {"arguments": {}}}]}', 'replies[0]: tool_call: a tool call is {"name": '),
        ('{"replies": [{"tool_call": {"name": "f", "arguments": []}}]}', "a tool call has a name and arguments"),
        ('{"model": ""}', "script.json: model must be a non-empty string"),
        ('{"max_model_len": 0}', "script.json: max_model_len must be a positive integer (tokens), not 0"),
        ('{"stream_delay_s": 600}', "script.json: stream_delay_s is 600; give at most 60 s"),
    ],
)  # fmt: skip
def test_an_unusable_script_is_one_line_and_exit_2(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "script.json").write_text(content)
    done = run("--port", "0", "--script", "script.json", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    [line] = done.stderr.splitlines()
    assert line.startswith("python -m tokens.testing.server: ") and message in line


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--token-ids", "75,x"], "--token-ids: '75,x' is not ids separated by commas, such as 75,107,2"),
        (["--token-ids", "75,999"], "--token-ids: token_ids[1] is 999, not an id of the fake's tokenizer"),
        (["--error", "oops"], "--error: 'oops' is not an HTTP status such as 503"),
        (["--error", "302"], "--error: error must be an HTTP status from 400 to 599, not 302"),
        (["--tool-call", "get_time"], '--tool-call: not JSON; give \'{"name": "get_time"'),
        (["--max-model-len", "0"], "--max-model-len must be a positive number of tokens, not 0"),
        (["--stream-delay", "-1"], "--stream-delay must be from 0 to 60 seconds, not -1.0"),
    ],
)
def test_an_unusable_option_is_one_line_and_exit_2(arguments: list[str], message: str) -> None:
    done = run("--port", "0", *arguments)
    assert (done.returncode, done.stdout) == (2, "")
    [line] = done.stderr.splitlines()
    assert message in line


def test_a_malformed_option_is_argparse_usage_and_exit_2() -> None:
    done = run("--port", "70000")
    assert done.returncode == 2 and "--port: 70000 is not a TCP port (0 to 65535; 0: any free one)" in done.stderr
    assert "Traceback" not in done.stderr
