"""Run a rollout-shaped workload through a sandbox provider stack and print its telemetry, or check a
stack config. Exit codes: 0 all sessions ok and nothing held; 1 a sandbox leaked; 2 usage or config
error; 3 some sessions failed, nothing leaked; 130 / 143 interrupted by SIGINT / SIGTERM (every
sandbox closed; 1 instead if one could not be)."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from importlib import metadata
from types import FrameType
from typing import Any, NoReturn

import anyio

from ._cli_export import EXPORTS, UsageError, start_telemetry
from ._cli_report import configure_logging, draw, progress, table
from ._cli_workload import RunState, workload
from ._config import ConfigError, ResolvedStack, load_config, resolve_config
from ._protocol import SandboxProvider
from ._release_accounting import ReleaseAccountingMiddleware

EXIT_OK = 0
EXIT_LEAKED = 1
EXIT_USAGE = 2
EXIT_SESSIONS_FAILED = 3

DEFAULT_CONFIG: dict[str, Any] = {
    "provider": {"local": {"isolation": "none"}},
    "middleware": [
        "tracing",
        "metrics",
        "release_accounting",
        {
            "retry": {  # creates: only failures that say the sandbox was not created
                "attempts": 5,
                "timeout": 120,
                "operations": ["create"],
                "on": ["SandboxCreateError", "ConnectionError"],
                "budget": {"max_tokens": 100, "token_ratio": 0.1},
            }
        },
        {
            "retry": {  # closes: any provider or connection failure, since closing twice is harmless
                "attempts": 5,
                "timeout": 20,
                "wait_initial": 0.05,
                "wait_max": 1,
                "wait_jitter": 0.05,
                "operations": ["close"],
                "on": ["SandboxError", "ConnectionError", "TimeoutError"],
            }
        },
    ],
}


class _Interrupted(BaseException):
    """SIGTERM outside the workload (which handles signals itself); SIGINT is KeyboardInterrupt."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.signal = signal.Signals(number)


def _raise_interrupted(number: int, frame: FrameType | None) -> NoReturn:
    raise _Interrupted(number)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the argument (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
        too_small = minimum is not None and value < minimum
        if too_small or (maximum is not None and value > maximum):
            allowed = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, not {text!r}")
    return value


def _version() -> str:
    try:
        return metadata.version("llm-sandbox-middleware")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sandbox-middleware", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,check}")
    run = sub.add_parser("run", help="run a rollout-shaped workload through a stack and print its telemetry",
                         description=__doc__)  # fmt: skip
    run.add_argument("config", nargs="?", help="YAML stack config (default: local provider, full recommended stack)")
    run.add_argument("--sessions", type=_integer(1), default=50, help="sessions to run (default 50)")
    run.add_argument("--concurrency", type=_integer(1), default=8, help="sessions at once (default 8)")
    run.add_argument("--commands", type=_integer(0), default=3, help="commands per session (default 3)")
    run.add_argument(
        "--export",
        choices=EXPORTS,
        default="none",
        help="where metric data also goes: console (one JSON line on stderr), otlp (metrics and spans; the "
        "standard OTEL_EXPORTER_OTLP_* variables), prometheus (serves /metrics)",
    )
    run.add_argument("--prometheus-port", type=_integer(1, 65535), default=9464,
                     help="port of /metrics with --export prometheus (default 9464)")  # fmt: skip
    run.add_argument("--prometheus-host", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)")
    run.add_argument("--linger", type=_seconds, default=0.0, help="seconds to keep exporting after the run")
    run.add_argument("--faults", default="", help="inject provider faults, e.g. create=0.1,close=0.05,exec=0.01")
    run.add_argument("--seed", type=_integer(), default=None, help="seed of the fault injector (printed when random)")
    run.add_argument("--verbose", action="store_true", help="also log a warning for every retry")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="draw a progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip
    check = sub.add_parser("check", help="validate a config and print the resolved stack, outermost first",
                           description="Validate a stack config (everything run would refuse) and print the "
                           "resolved stack, outermost first. Exit code 0 when valid, 2 otherwise.")  # fmt: skip
    check.add_argument("config", help="YAML stack config to validate")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            print(_resolve(args.config).describe())
            return EXIT_OK
        return _run_command(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"sandbox-middleware: config error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as exc:
        print(f"sandbox-middleware {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, _Interrupted) as exc:
        caught = exc.signal if isinstance(exc, _Interrupted) else signal.SIGINT
        print(f"sandbox-middleware: interrupted by {caught.name}", file=sys.stderr)
        return 128 + caught


def _resolve(path: str) -> ResolvedStack:
    return resolve_config(load_config(path), source=path)


def _run_command(args: argparse.Namespace) -> int:
    from .testing import FaultInjectingProvider, parse_faults

    signal.signal(signal.SIGTERM, _raise_interrupted)
    resolved = _resolve(args.config) if args.config else resolve_config(DEFAULT_CONFIG, source="the default config")
    try:
        rates = parse_faults(args.faults)
    except ValueError as exc:
        raise UsageError(f"argument --faults: {exc}") from exc
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    injector: list[FaultInjectingProvider] = []

    def wrap(provider: SandboxProvider) -> SandboxProvider:
        injector.append(FaultInjectingProvider(provider, seed=seed, failure_rates=rates))
        return injector[0]

    telemetry = start_telemetry(args.export, args.prometheus_host, args.prometheus_port)
    try:
        provider = resolved.build(
            meter_provider=telemetry.meter_provider,
            tracer_provider=telemetry.tracer_provider,
            wrap_provider=wrap if rates else None,
        )
        where = f"config {args.config}" if args.config else "the built-in default config"
        print(f"stack from {where}:\n{resolved.describe()}", file=sys.stderr)
        if rates:
            print(f"injecting faults {rates} with seed {seed}", file=sys.stderr)
        show_progress = sys.stderr.isatty() if args.progress is None else args.progress
        configure_logging(args.verbose, show_progress)
        run = RunState(args.sessions)
        accounting = _find_accounting(provider)
        bar = progress(accounting) if show_progress else None
        anyio.run(partial(workload, provider, run, concurrency=args.concurrency, commands=args.commands,
                          background=bar))  # fmt: skip
        signal.signal(signal.SIGTERM, _raise_interrupted)  # the event loop put the default action back
        if show_progress:
            draw(run, accounting, final=True)
        held = accounting.held() if accounting is not None else []
        truly_alive = sorted(injector[0].alive) if injector else []
        verdict = _exit_code(run, leaked=bool(held or truly_alive))
        title = (f"sandbox-middleware run: {args.sessions} sessions, concurrency {args.concurrency}, "
                 f"{args.commands} commands each, provider {resolved.provider.name}")  # fmt: skip
        # The verdict is in: from here a signal ends the report or the linger, never changes the exit code.
        with contextlib.suppress(KeyboardInterrupt, _Interrupted):
            print(table(title, run, telemetry.table_reader, accounting, held), flush=True)
            if truly_alive:
                print(f"the provider still holds {len(truly_alive)} sandbox(es): {', '.join(truly_alive)}", flush=True)
            time.sleep(args.linger)  # keep exporting
        return verdict
    finally:
        for note in telemetry.shutdown():
            print(note, file=sys.stderr)


def _exit_code(run: RunState, *, leaked: bool) -> int:
    if leaked:
        return EXIT_LEAKED
    if run.interrupted_by is not None:
        return 128 + run.interrupted_by
    return EXIT_SESSIONS_FAILED if run.failed else EXIT_OK


def _find_accounting(provider: Any) -> ReleaseAccountingMiddleware | None:
    while provider is not None:
        if isinstance(provider, ReleaseAccountingMiddleware):
            return provider
        provider = getattr(provider, "inner", None)
    return None
