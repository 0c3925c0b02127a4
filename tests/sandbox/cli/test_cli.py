"""The main job end to end, as a subprocess: `sandbox-middleware run` and `check`.

A test whose subprocess runs sandboxes under bwrap is marked ``requires_bwrap`` (``tests/bwrap.py``): where
bwrap cannot run it is skipped, as the tests in this process are by a ``BwrapUnavailableError``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandbox_middleware import LocalProvider
from sandbox_middleware._config import resolve_config
from sandbox_middleware.cli._main import DEFAULT_CONFIG
from tests.bwrap import path_without_bwrap
from tests.leftovers import left_behind
from tests.vllm.server import free_port
from tests.without_modules import env_without

CLI = [sys.executable, "-m", "sandbox_middleware"]


def needs_bwrap(config: dict[str, object]) -> bool:
    """Whether the config's provider is the local one under bwrap (LocalProvider's default isolation)."""
    provider = resolve_config(config).provider
    isolation = provider.options.get("isolation", inspect.signature(LocalProvider).parameters["isolation"].default)
    return bool(provider.cls is LocalProvider and isolation == "bwrap")


# The subprocess runs sandboxes of the built-in default config: it needs bwrap when that config does.
default_stack = pytest.mark.requires_bwrap(needs_bwrap(DEFAULT_CONFIG))
FAST_CREATE_RETRIES = """\
provider: local
middleware:
  - metrics
  - release_accounting
  - retry: {attempts: 3, wait_initial: 0.01, wait_max: 0.02, wait_jitter: 0.01, on: [SandboxCreateError]}
"""


def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def row(output: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}\s+(.*)$", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return match.group(1)


def forks_made(output: str) -> int:
    """The number the line under the table of a ``--fork`` run gives."""
    match = re.search(r"^forks made: (\d+) \(", output, re.MULTILINE)
    assert match, f"no forks line in:\n{output}"
    return int(match.group(1))


def retries(output: str) -> dict[str, int]:
    create, close, other = row(output, "retries create / close / other").split(" / ")
    return {"create": int(create), "close": int(close), "other": int(other)}


def assert_clean_run(output: str, sessions: int, concurrency: int) -> None:
    """The report of a run whose ``sessions`` all succeeded: each started one sandbox, at most
    ``concurrency`` were active at once, none is active or held at the end, each startup was measured."""
    assert row(output, "sessions ok / failed") == f"{sessions} / 0"
    assert row(output, "sandboxes started") == str(sessions)
    peak, final = row(output, "gym.sandbox.active peak / final").split(" / ")
    assert 1 <= int(peak) <= concurrency and final == "0"
    assert row(output, "sandboxes still held") == "0"
    assert f"({sessions} samples)" in row(output, "startup ms p50 / p95 / max")


@default_stack
def test_default_run_leaks_nothing() -> None:
    """With no config, a run on the local provider exits 0, leaks nothing, and peaks at most at concurrency."""
    done = run("run", "--sessions", "24", "--concurrency", "4", "--commands", "2")
    assert done.returncode == 0, done.stderr
    assert_clean_run(done.stdout, sessions=24, concurrency=4)
    assert "(48 samples)" in row(done.stdout, "exec ms p50 / p95 / max")
    assert "1. tracing" in done.stderr and "4. retry" in done.stderr and "5. retry" in done.stderr


@default_stack
def test_console_script_is_installed() -> None:
    """The console script runs the same main job."""
    script = shutil.which("sandbox-middleware") or str(Path(sys.executable).parent / "sandbox-middleware")
    done = subprocess.run(
        [script, "run", "--sessions", "2", "--commands", "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


@default_stack
def test_quick_start_fault_run_holds_nothing_and_retries_closes() -> None:
    """The README's fault run: create and close faults are retried away, nothing is held at the end.

    Exec faults are not retried (a command may have run), so their sessions fail: exit code 3.
    """
    done = run(
        "run", "--sessions", "200", "--concurrency", "32", "--faults", "create=0.1,close=0.05,exec=0.01", "--seed", "11"
    )
    out = done.stdout
    assert row(out, "sandboxes still held") == "0"
    assert row(out, "gym.sandbox.active peak / final").endswith("/ 0")
    counted = retries(out)
    assert counted["create"] > 0 and counted["close"] > 0, out
    assert not re.search(r"^  (create|close) ", out, re.MULTILINE), "a create or close failure was not retried away"
    ok, failed = (int(n) for n in row(out, "sessions ok / failed").split(" / "))
    assert ok + failed == 200
    assert done.returncode == (3 if failed else 0), out + done.stderr
    assert "with seed 11" in done.stderr and "Traceback" not in done.stderr


@default_stack
def test_leak_exits_1() -> None:
    """When closes never succeed, the run names the held sandboxes and exits 1."""
    done = run("run", "--sessions", "3", "--concurrency", "3", "--faults", "close=1.0", "--seed", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    held = row(done.stdout, "sandboxes still held")
    assert held.startswith("3: local-")


@pytest.mark.requires_bwrap  # provider: local, under bwrap
def test_every_session_failing_exits_3(tmp_path: Path) -> None:
    """--faults create=1.0: every session fails, nothing leaks, the exit code says so (3, not 0)."""
    config = tmp_path / "fast.yaml"
    config.write_text(FAST_CREATE_RETRIES)
    done = run("run", str(config), "--sessions", "6", "--concurrency", "3", "--faults", "create=1.0", "--seed", "2")
    assert done.returncode == 3, done.stdout + done.stderr
    assert row(done.stdout, "sessions ok / failed") == "0 / 6"
    assert row(done.stdout, "sandboxes still held") == "0"
    failures = [line for line in done.stderr.splitlines() if "a session failed: " in line]
    assert failures == ["ERROR sandbox_middleware: a session failed: InjectedCreateError: injected create failure"]


@pytest.fixture
def private_tmpdir(tmp_path: Path) -> Path:
    """A TMPDIR of the test's own, so what the subprocess leaves there is visible."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    return directory


@default_stack
@pytest.mark.parametrize(
    ("number", "fork"),
    [(signal.SIGINT, []), (signal.SIGTERM, []), (signal.SIGTERM, ["--fork", "4"])],
    ids=["SIGINT", "SIGTERM", "SIGTERM-fork"],
)
def test_signal_mid_run_closes_everything(number: signal.Signals, fork: list[str], private_tmpdir: Path) -> None:
    """SIGINT / SIGTERM mid-run: no sandbox directory left, the table marked interrupted, 130 / 143, no traceback.

    A hundred million sessions: workers pull them one by one, so nothing grows with the count. With
    ``--fork``, the forks in flight are made and closed and their snapshots deleted: the provider's
    base directory is left empty.
    """
    env = {**os.environ, "TMPDIR": str(private_tmpdir)}
    process = subprocess.Popen(
        [*CLI, "run", "--sessions", "100000000", "--concurrency", "8", "--no-progress", *fork],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not any("local-" in name for name in left_behind(private_tmpdir)):
            assert process.poll() is None and time.monotonic() < deadline, "no sandbox was created"
            time.sleep(0.05)
        if fork:
            time.sleep(1.0)  # sessions prepared, forked and forking
        process.send_signal(number)
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + number, out + err
    assert f"INTERRUPTED by {number.name}" in out.splitlines()[0]
    assert row(out, "sandboxes still held") == "0"
    assert row(out, "gym.sandbox.active peak / final").endswith("/ 0")
    cancelled, not_run = (int(n) for n in row(out, "sessions cancelled / not run").split(" / "))
    assert cancelled <= 8
    assert 0 < not_run < 100_000_000
    assert "Traceback" not in err, err
    assert left_behind(private_tmpdir) == []
    [base] = private_tmpdir.glob("llm-sandbox-middleware-*")  # LocalProvider's default base_dir
    assert sorted(entry.name for entry in base.iterdir()) == [], "the run left sandboxes or snapshots there"
    assert forks_made(out) > 0 if fork else "forks made" not in out


BAD_ARGUMENTS = [
    (["--sessions", "abc"], "argument --sessions: must be a whole number, not 'abc'"),
    (["--sessions", "0"], "argument --sessions: must be at least 1, not 0"),
    (["--concurrency", "-2"], "argument --concurrency: must be at least 1, not -2"),
    (["--linger", "-1"], "argument --linger: must be a finite number of seconds, 0 or more, not '-1'"),
    (["--linger", "inf"], "argument --linger: must be a finite number of seconds"),
    (["--prometheus-port", "99999"], "argument --prometheus-port: must be from 1 to 65535, not 99999"),
    (["--export", "carrier-pigeon"], "argument --export: invalid choice: 'carrier-pigeon'"),
    (["--faults", "create=2"], "argument --faults: bad fault 'create=2'"),
    (["--export", "prometheus", "--prometheus-host", "192.0.2.1"],  # TEST-NET-1: never this machine's address
     "argument --prometheus-host: cannot serve /metrics on 192.0.2.1:9464"),
]  # fmt: skip


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_each_argument_error_is_one_line(arguments: list[str], message: str) -> None:
    """A bad argument: exit 2 and one line naming it, no usage dump, no traceback."""
    done = run("run", *arguments, "--sessions" if "--sessions" not in arguments else "--commands", "1")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert message in done.stderr
    assert done.stdout == ""


def test_busy_prometheus_port_is_one_line() -> None:
    """A port already in use: exit 2 with one line naming --prometheus-port, before any sandbox exists."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run("run", "--sessions", "1", "--export", "prometheus", "--prometheus-port", str(port))
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert f"argument --prometheus-port: cannot serve /metrics on 127.0.0.1:{port}" in done.stderr


def test_version_and_help() -> None:
    """--version prints the version; help texts are plain (no reST backticks) and `check` says what CONFIG is."""
    done = run("--version")
    assert done.returncode == 0 and re.fullmatch(r"sandbox-middleware \d+\.\d+\.\d+\S*\n", done.stdout)
    for command in ([], ["run"], ["check"]):
        helped = run(*command, "--help")
        assert helped.returncode == 0 and "``" not in helped.stdout
        assert "Exit codes" in helped.stdout or command == ["check"]
    assert re.search(r"^  config\s+YAML stack config to validate", run("check", "--help").stdout, re.MULTILINE)


@default_stack
def test_prometheus_exporter_serves_while_running() -> None:
    """With --export prometheus, /metrics serves the active counter and the duration histograms."""
    port = free_port()
    process = subprocess.Popen(
        [*CLI, "run", "--sessions", "20", "--concurrency", "4", "--export", "prometheus",
         "--prometheus-port", str(port), "--linger", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        body = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.TransportError:
                body = ""
            if "gym_sandbox_exec_duration_ms" in body and "gym_sandbox_startup_duration_ms" in body:
                break
            time.sleep(0.2)
        assert re.search(r"^gym_sandbox_active\S*\{.*nemo_gym_sandbox_provider=\"local\".*\} ", body, re.MULTILINE), (
            body
        )
        assert re.search(r"^gym_sandbox_startup_duration_ms\S*_bucket\{.*le=\"1800000\"", body, re.MULTILINE), body
        assert re.search(r"^gym_sandbox_exec_duration_ms\S*_count", body, re.MULTILINE), body
        assert process.stdout is not None
        table = ""
        for line in process.stdout:  # until the table's last line: the run is over, it lingers now
            table += line
            if line.startswith("failures"):
                break
        process.terminate()  # ends the linger; the run's verdict stands
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, out + err
    assert row(table, "sessions ok / failed") == "20 / 0" and "Traceback" not in err


BLOCK_OTLP = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from sandbox_middleware.cli import main
sys.exit(main())
"""


def test_missing_exporter_names_the_extra() -> None:
    """Asking for an exporter that is not installed says which extra to install, in one line."""
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_OTLP, "run", "--sessions", "1", "--export", "otlp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "pip install 'llm-sandbox-middleware[otlp]'" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


@default_stack
@pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter.otlp") is None,
    reason="the otlp extra is not installed: pip install -e '.[otlp]'",
)
def test_unreachable_collector_is_reported_once() -> None:
    """--export otlp with nothing listening: the exporters' retry chatter becomes one line naming it (no password)."""
    port = free_port()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:hunter2@127.0.0.1:{port}"}
    endpoint = f"http://***@127.0.0.1:{port}"  # the password is never printed
    env.pop("OTEL_EXPORTER_OTLP_TIMEOUT", None)
    done = run("run", "--sessions", "3", "--commands", "1", "--export", "otlp", env=env)
    assert done.returncode == 0, done.stderr
    assert row(done.stdout, "sessions ok / failed") == "3 / 0"
    lines = [line for line in done.stderr.splitlines() if "telemetry:" in line]
    assert len(lines) == 1 and f"the collector at {endpoint} was unreachable" in lines[0], done.stderr
    assert "Transient error" not in done.stderr and "Traceback" not in done.stderr and "hunter2" not in done.stderr


def test_check_prints_the_stack_and_rejects_bad_configs(tmp_path: Path) -> None:
    """check prints the resolved stack outermost first; a bad config exits 2 naming the problem."""
    good = tmp_path / "good.yaml"
    good.write_text(
        "provider:\n  local: {isolation: none}\n"
        "middleware:\n  - metrics\n  - retry: {attempts: 5, on: [ConnectionError]}\n"
    )
    done = run("check", str(good))
    assert done.returncode == 0
    assert done.stdout.splitlines()[2:] == [
        "  1. metrics -> MetricsMiddleware()  [built-in (llm-sandbox-middleware)]",
        "  2. retry -> RetryMiddleware(attempts=5, on=(ConnectionError,))  [built-in (llm-sandbox-middleware)]",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("provider: local\nmiddleware:\n  - retry: {attempts: 5, timeout: soon}\n")
    done = run("check", str(bad))
    assert done.returncode == 2
    assert f"{bad}: middleware[0] (retry): option 'timeout' must be float or null, not 'soon'" in done.stderr
    done = run("run", str(bad))
    assert done.returncode == 2 and "sessions ok" not in done.stdout


def test_check_and_run_reject_the_same_values_one_error_each(tmp_path: Path) -> None:
    """NaN, infinite, zero and negative values: check and run both exit 2 with the same lines, one per
    bad option, each naming the file, the entry and the option; run starts nothing."""
    config = tmp_path / "numbers.yaml"
    config.write_text(
        "provider: local\n"
        "middleware:\n"
        "  - tracing: {command_max_length: -1}\n"
        "  - retry: {attempts: 0, wait_initial: .nan, timeout: .inf, budget: {max_tokens: 10, token_ratio: -0.5}}\n"
    )
    expected = [
        f"{config}: middleware[0] (tracing): option 'command_max_length' must be >= 0, not -1",
        f"{config}: middleware[1] (retry): option 'attempts' must be >= 1, not 0",
        f"{config}: middleware[1] (retry): option 'wait_initial' must be a finite number, not nan",
        f"{config}: middleware[1] (retry): option 'timeout' must be a finite number, not inf (null means no limit)",
        f"{config}: middleware[1] (retry): option 'budget.token_ratio' must be > 0, not -0.5",
    ]
    for command in ("check", "run"):
        done = run(command, str(config))
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.splitlines() == [f"sandbox-middleware: config error: {line}" for line in expected]
        assert done.stdout == ""


def test_invalid_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    """A YAML syntax error names the file, line and column, not PyYAML's `<unicode string>`."""
    config = tmp_path / "broken.yaml"
    config.write_text("provider: local\nmiddleware: [tracing\n")
    done = run("check", str(config))
    assert done.returncode == 2
    assert f"{config} is not valid YAML: line 3, column 1:" in done.stderr
    assert "<unicode string>" not in done.stderr and len(done.stderr.splitlines()) == 1


@default_stack
def test_console_export_keeps_stdout_for_the_table() -> None:
    """--export console writes the metric data as one JSON line on stderr; stdout is only the table."""
    done = run("run", "--sessions", "2", "--commands", "1", "--export", "console")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("sandbox-middleware run:") and "resource_metrics" not in done.stdout
    exported = [line for line in done.stderr.splitlines() if line.startswith('{"resource_metrics"')]
    assert len(exported) == 1
    names = set(re.findall(r'"name": "(gym\.sandbox\.[a-z_]+)"', exported[0]))
    assert {"gym.sandbox.active", "gym.sandbox.startup_duration_ms", "gym.sandbox.exec_duration_ms"} <= names


UNBUILDABLE = {  # config -> what the one line says (after the provider's name)
    "provider: {local: {no_such_option: 1}}\nmiddleware: [metrics]\n": "unknown option 'no_such_option'",
    "provider: {local: {sandbox_uid: 0}}\nmiddleware: [metrics]\n": "option 'sandbox_uid' must be > 0 and <=",
    "provider: {local: {isolation: none, ro_paths: [relative]}}\nmiddleware: [metrics]\n": "cannot be built: ",
    "provider: local\nmiddleware: [metrics, release_accounting]\n": "cannot be built: "
    "LocalProvider(isolation='bwrap'): no 'bwrap' executable on PATH; install bubblewrap (apt-get install -y "
    "bubblewrap) or use isolation='none'",
}  # fmt: skip


@pytest.mark.parametrize("command", ["run", "check", "reap"])
@pytest.mark.parametrize(
    "config", list(UNBUILDABLE), ids=["unknown-option", "refused-value", "refused-by-constructor", "no-bwrap"]
)
def test_provider_that_cannot_be_built_is_one_line(config: str, command: str, tmp_path: Path) -> None:
    """A provider the config validates but this machine cannot build (bwrap hidden from PATH here), or an
    option it refuses: exit 2, one line on stderr naming the provider and what is wrong, nothing run."""
    path = tmp_path / "stack.yaml"
    path.write_text(config)
    env = {**os.environ, "PATH": path_without_bwrap(tmp_path / "bin", first=[Path(sys.executable).parent])}
    done = run(command, str(path), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "provider 'local'" in done.stderr and UNBUILDABLE[config] in done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr


DEFAULT_UNDER_BWRAP = """
import sys
from sandbox_middleware.cli import _main
_main.DEFAULT_CONFIG = {**_main.DEFAULT_CONFIG, "provider": "local"}  # the local provider, under bwrap
sys.exit(_main.main())
"""


def test_default_run_without_bwrap_is_one_line(tmp_path: Path) -> None:
    """run with no config, its provider under bwrap, on a machine without bwrap: exit 2 and one line."""
    env = {**os.environ, "PATH": path_without_bwrap(tmp_path / "bin", first=[Path(sys.executable).parent])}
    done = subprocess.run(
        [sys.executable, "-c", DEFAULT_UNDER_BWRAP, "run", "--sessions", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "sandbox-middleware run: error: provider 'local' of the built-in default config cannot be built: "
        "LocalProvider(isolation='bwrap'): no 'bwrap' executable on PATH; install bubblewrap "
        "(apt-get install -y bubblewrap) or use isolation='none'"
    ]
    assert done.stdout == ""


FAULTS = "create=0.1,close=0.05,exec=0.02,lost_create=0.05"


def test_the_same_seed_fails_the_same_sessions_at_any_concurrency() -> None:
    """`--seed` makes a fault run reproducible: each session draws its faults from a stream of its own, so the
    same sessions fail and the same operations are retried whatever ran beside them (it was one stream
    shared by all: 195/5, 194/6 and 192/8 sessions for three runs of --seed 7)."""
    labels = ("sessions ok / failed", "retries create / close / other", "orphans found / reaped")
    seen = []
    for concurrency in ("32", "32", "5"):
        done = run(
            "run",
            "--sessions",
            "120",
            "--concurrency",
            concurrency,
            "--commands",
            "2",
            "--faults",
            FAULTS,
            "--seed",
            "7",
        )
        assert done.returncode in (0, 3), done.stderr
        failures = done.stdout[done.stdout.index("failures") :]
        seen.append(([row(done.stdout, label).split(":")[0] for label in labels], failures))
    assert seen[0] == seen[1] == seen[2], seen
    ok, failed = (int(n) for n in seen[0][0][0].split(" / "))
    assert failed > 0 and ok + failed == 120  # faults landed: the equality says something


def test_an_option_the_provider_ignores_is_refused(tmp_path: Path) -> None:
    """`--image` with the local provider (which runs no images) is one line, exit 2, before any sandbox."""
    done = run("run", "--image", "python:3.12", "--sessions", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "sandbox-middleware run: error: argument --image: provider 'local' (LocalProvider) runs no images, its "
        "sandboxes run this machine's own programs; drop --image, or run --provider docker --image python:3.12"
    ]
    config = tmp_path / "local.yaml"
    config.write_text("provider: {local: {isolation: none}}\nmiddleware: [metrics]\n")
    from_config = run("run", str(config), "--image", "python:3.12", "--sessions", "1")
    assert from_config.returncode == 2 and "argument --image: provider 'local'" in from_config.stderr
    assert "sessions ok" not in from_config.stdout


@pytest.mark.parametrize(
    ("extra", "modules", "argv"),
    [
        ("otlp", ["opentelemetry.exporter.otlp"], ["--export", "otlp"]),
        ("prometheus", ["opentelemetry.exporter.prometheus", "prometheus_client"], ["--export", "prometheus"]),
        ("ray", ["ray"], ["--ray", "127.0.0.1:1"]),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path, extra: str, modules: list[str], argv: list[str]) -> None:
    done = run("run", "--sessions", "1", *argv, env=env_without(tmp_path, *modules))
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "error" in line]
    assert f"needs the '{extra}' extra" in line and f"pip install 'llm-sandbox-middleware[{extra}]'" in line, line
    assert "Traceback" not in done.stderr and "sessions ok" not in done.stdout


def test_help_is_plain_text_and_every_option_says_what_it_does() -> None:
    """`--help` of the program and of each command: no raw markup (backticks), no option without help."""
    from sandbox_middleware.cli._main import _parser

    parser = _parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for name, command in [("", parser), *commands.choices.items()]:
        text = command.format_help()
        assert "`" not in text, (name, text)
        for action in command._actions:
            assert action.help, (name, action.option_strings or action.dest)


def test_a_lost_ray_workers_report_never_says_run_none() -> None:
    """Without an ownership layer there is no run to reap: the report says what closes the sandboxes instead."""
    from sandbox_middleware.cli._ray import _reap_hint

    default = resolve_config(DEFAULT_CONFIG)
    bare = resolve_config({"provider": {"local": {"isolation": "none"}}, "middleware": ["metrics"]})
    no_config = argparse.Namespace(config=None)
    assert _reap_hint(no_config, default, "r1") == (
        "sandbox-middleware reap --provider local --run r1 closes them (or their TTL)"
    )
    assert _reap_hint(argparse.Namespace(config="stack.yaml"), default, "r1").startswith(
        "sandbox-middleware reap stack.yaml --run r1"
    )
    hint = _reap_hint(no_config, bare, None)
    assert "None" not in hint and "no ownership layer" in hint and "reap" in hint
