"""Run a rollout-shaped workload through a sandbox provider stack and print its telemetry, check a
stack config, or reap the sandboxes a crashed or finished run left behind. Exit codes of run: 0 all
sessions ok and nothing held; 1 a sandbox or snapshot leaked (or a Ray worker was lost: reap its run); 2 usage
or config error, or a provider that cannot be built here; 3 some sessions failed, nothing leaked;
130 / 143 interrupted by SIGINT / SIGTERM (every sandbox closed; 1 instead if one could not be). Of
reap: 0 every chosen sandbox closed (or listed, with --dry-run); 1 one could not be closed; 2 usage
or config error, a provider that cannot be built here, or one that cannot list its sandboxes."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from importlib import metadata
from types import FrameType
from typing import Any, NoReturn

import anyio

from .._config import ResolvedStack, load_config, resolve_config
from .._errors import ConfigError, SandboxError, UsageError
from .._protocol import SandboxProvider
from .._reaper import reap
from ..middleware._recommended import recommended_middleware_config
from ..middleware._warm_pool import WarmPoolMiddleware
from ..providers.local import LocalProvider
from ..testing import parse_faults
from ._export import EXPORTS, start_telemetry
from ._process import ProcessResult, RunOptions, combine, orphans_row, run_process, with_layer, with_run_id
from ._report import configure_logging, table
from ._workload import RunState

EXIT_OK = 0
EXIT_LEAKED = 1
EXIT_USAGE = 2
EXIT_SESSIONS_FAILED = 3
MAX_FORKS = 256
"""``--fork``'s bound: an RL group (8 to 64 samples of one task), with room, never a fleet per session."""

DEFAULT_CONFIG: dict[str, Any] = {
    "provider": {"local": {"isolation": "none"}},
    "middleware": [
        *recommended_middleware_config(
            retry=[
                {  # creates: only failures that say the sandbox was not created
                    "attempts": 5,
                    "timeout": 120,
                    "operations": ["create"],
                    "on": ["SandboxCreateError", "ConnectionError"],
                    "budget": {"max_tokens": 100, "token_ratio": 0.1},
                },
                {  # closes: any provider or connection failure, since closing twice is harmless
                    "attempts": 5,
                    "timeout": 20,
                    "wait_initial": 0.05,
                    "wait_max": 1,
                    "wait_jitter": 0.05,
                    "operations": ["close"],
                    "on": ["SandboxError", "ConnectionError", "TimeoutError"],
                },
            ],
            admission={},  # no caps: a 429 waits out its Retry-After, a hard quota fails typed and fast
        ),
        "ownership",  # innermost: every create, retried ones too, names this run and process
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


def _finite(unit: str, *, above_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of ``unit``, 0 or more (above 0 with ``above_zero``)."""
    least = "above 0" if above_zero else "0 or more"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, not {text!r}") from None
        if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit}, {least}, not {text!r}")
        return value

    return parse


_seconds = _finite("seconds", above_zero=False)
_rate = _finite("creates per second", above_zero=True)


def _version() -> str:
    try:
        return metadata.version("llm-sandbox-middleware")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _stack_source(command: argparse.ArgumentParser, config_help: str, provider_help: str) -> None:
    """A command's two ways to name its stack: a YAML config (positional), or ``--provider NAME``."""
    command.add_argument("config", nargs="?", help=config_help)
    command.add_argument("--provider", default=None, metavar="NAME", help=provider_help)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sandbox-middleware", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{run,check,reap}", help="the command (each has its own --help)"
    )
    run = sub.add_parser(
        "run", help="run a rollout-shaped workload through a stack and print its telemetry", description=__doc__
    )
    _stack_source(
        run,
        "YAML stack config (default: local provider, full recommended stack)",
        "without a config: the default stack over this provider (e.g. docker) with its defaults",
    )
    run.add_argument(
        "--image",
        default=None,
        metavar="IMAGE",
        help="the image every session's sandbox runs (spec.image; needed by docker)",
    )
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
    run.add_argument(
        "--prometheus-port",
        type=_integer(1, 65535),
        default=9464,
        help="port of /metrics with --export prometheus (default 9464)",
    )
    run.add_argument("--prometheus-host", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)")
    run.add_argument("--linger", type=_seconds, default=0.0, help="seconds to keep exporting after the run")
    run.add_argument(
        "--faults", default="", help="inject provider faults, e.g. create=0.1,close=0.05,exec=0.01,lost_create=0.1"
    )
    run.add_argument(
        "--seed",
        type=_integer(),
        default=None,
        help="seed of the fault injector (printed when random): the same seed fails the same "
        "sessions' operations, whatever the concurrency",
    )
    run.add_argument(
        "--think",
        type=_seconds,
        default=0.0,
        help="seconds each session waits after each command (the model writing its next turn)",
    )
    max_warm = int(WarmPoolMiddleware.BOUNDS["size"].high or 0)
    run.add_argument(
        "--warm",
        type=_integer(1, max_warm),
        default=None,
        metavar="N",
        help="keep N ready sandboxes in a warm pool (a warm_pool layer, as recommended)",
    )
    run.add_argument(
        "--fork",
        type=_integer(1, MAX_FORKS),
        default=None,
        metavar="N",
        help="each session's first command prepares its sandbox, whose snapshot N forks start from; the rest "
        "of its commands run in every fork (a group rollout; needs a provider with snapshots)",
    )
    run.add_argument(
        "--max-create-rate",
        type=_rate,
        default=None,
        metavar="R",
        help="admit at most R creates per second (the admission layer's max_create_rate)",
    )
    run.add_argument("--run-id", default=None, help="the run id the ownership layer stamps (default: a random one)")
    run.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help="spread the sessions over Ray actors on the cluster at ADDRESS (default: auto, the "
        "cluster 'ray start --head' started on this machine); needs the 'ray' extra",
    )
    run.add_argument("--workers", type=_integer(1), default=2, help="Ray actors with --ray (default 2)")
    run.add_argument(
        "--prometheus-sd-file",
        default=None,
        metavar="PATH",
        help="with --ray: each worker serves /metrics on a free port of --prometheus-host, and "
        "this file lists them for Prometheus's file_sd_configs",
    )
    run.add_argument("--verbose", action="store_true", help="also log a warning for every retry")
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when stderr is a terminal)",
    )
    check = sub.add_parser(
        "check",
        help="validate a config and print the resolved stack, outermost first",
        description="Validate a stack config (everything run would refuse) and print the "
        "resolved stack, outermost first. Exit code 0 when valid, 2 otherwise.",
    )
    check.add_argument("config", help="YAML stack config to validate")
    reap_ = sub.add_parser(
        "reap",
        help="close the sandboxes a crashed or finished run left behind",
        description="Close, and report by id, the sandboxes that the ownership layer "
        "stamped and whose owner process is gone (any run), or of one run (--run) whose "
        "owners are gone. A live owner's sandbox is left alone unless --force, and so is one "
        "whose owner's liveness cannot be told from here (another host, boot or PID namespace), "
        "listed as 'left alone'. Exit code "
        "0 when every chosen sandbox was closed (or listed, with --dry-run), 1 when one "
        "could not be, 2 on a usage or config error or a provider that cannot list.",
    )
    _stack_source(
        reap_,
        "YAML stack config (its provider is searched)",
        "instead of a config: search this provider, built with its defaults (e.g. docker); with neither, "
        "the default config's provider (what run uses without them)",
    )
    reap_.add_argument("--run", default=None, metavar="ID", help="only this run's sandboxes (its id is printed by run)")
    reap_.add_argument(
        "--force",
        action="store_true",
        help="with --run: also the run's sandboxes of live owners and of owners of unknown liveness",
    )
    reap_.add_argument("--dry-run", action="store_true", help="list what would be closed; close nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            resolved = _resolve(args.config)
            anyio.run(_provider(resolved, f"config {args.config}").aclose)
            print(resolved.describe())
            return EXIT_OK
        if args.command == "reap":
            return _reap_command(args)
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


def _provider(resolved: ResolvedStack, where: str) -> SandboxProvider:
    """The stack's provider, constructed before anything runs: one that cannot be built here (bwrap
    missing, an option its constructor refuses) is one line naming it."""
    layer = resolved.provider
    try:
        provider: SandboxProvider = layer.cls(**layer.options)
    except (SandboxError, TypeError, ValueError) as exc:  # SandboxError: ConfigError, BwrapUnavailableError ...
        raise UsageError(f"provider {layer.name!r} of {where} cannot be built: {' '.join(str(exc).split())}") from exc
    return provider


def _default_config(provider: str | None) -> dict[str, Any]:
    """The default config, over ``provider`` (with its defaults) when one is named."""
    return DEFAULT_CONFIG if provider is None else {**DEFAULT_CONFIG, "provider": {provider: {}}}


def _run_command(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _raise_interrupted)
    if args.config and args.provider:
        raise UsageError("argument --provider: name the provider in the config instead (its provider: key)")
    default = resolve_config(_default_config(args.provider), source="the default config") if not args.config else None
    resolved = default or _resolve(args.config)
    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        raise UsageError(f"argument --faults: {exc}") from exc
    if args.prometheus_sd_file and (args.ray is None or args.export != "prometheus"):
        raise UsageError("argument --prometheus-sd-file: needs --ray and --export prometheus")
    if args.provider == "docker" and not args.image:
        raise UsageError("argument --image: --provider docker needs the image every session's sandbox runs")
    if args.image is not None and issubclass(resolved.provider.cls, LocalProvider):
        raise UsageError(
            f"argument --image: provider {resolved.provider.name!r} (LocalProvider) runs no images, its sandboxes "
            f"run this machine's own programs; drop --image, or run --provider docker --image {args.image}"
        )
    if args.fork is not None and args.commands == 0:
        raise UsageError("argument --fork: needs --commands 1 or more (the first command prepares the forks' state)")
    if args.warm is not None:
        resolved = with_layer(resolved, "warm_pool", {"size": args.warm})
    if args.max_create_rate is not None:
        resolved = with_layer(resolved, "admission", {"max_create_rate": args.max_create_rate})
    resolved, run_id = with_run_id(resolved, args.run_id or uuid.uuid4().hex[:16])
    options = RunOptions(
        args.sessions,
        args.concurrency,
        args.commands,
        args.think,
        faults,
        args.seed if args.seed is not None else int(time.time()) % 100_000,
        image=args.image,
        fork=args.fork,
    )
    telemetry = start_telemetry(args.export, args.prometheus_host, args.prometheus_port) if args.ray is None else None
    try:
        where = f"config {args.config}" if args.config else "the built-in default config"
        # Over Ray, each worker builds the provider on its own node.
        provider = _provider(resolved, where) if telemetry is not None else None
        print(f"stack from {where}:\n{resolved.describe()}", file=sys.stderr)
        print(
            f"run id {run_id}" if run_id else "run id: none (no ownership layer; reap cannot find this run)",
            file=sys.stderr,
        )
        if faults:
            print(f"injecting faults {faults} with seed {options.seed}", file=sys.stderr)
        show_progress = sys.stderr.isatty() if args.progress is None else args.progress
        configure_logging(args.verbose, show_progress and telemetry is not None)
        report = partial(_report, args, resolved.provider.name)
        if telemetry is None:
            from ._ray import run_on_ray

            return run_on_ray(args, resolved, options, run_id, report)
        result = run_process(resolved, options, telemetry, show_progress=show_progress, provider=provider)
        signal.signal(signal.SIGTERM, _raise_interrupted)  # the event loop put the default action back
        return report([result], [], 0)
    finally:
        for note in telemetry.shutdown() if telemetry is not None else ():
            print(note, file=sys.stderr)


def _report(args: argparse.Namespace, provider: str, results: list[ProcessResult], lines: list[str], lost: int) -> int:
    """Print the table of the run (of every worker's results), keep exporting for ``--linger`` seconds,
    and return the exit code."""
    result = results[0] if len(results) == 1 and not lines else combine(results, args.sessions)
    unclosed = [entry for entry in result.orphans or () if not entry.closed]
    leaked = result.held or result.held_snapshots or result.alive or unclosed or lost  # lost: reap it
    verdict = _exit_code(result.run, leaked=bool(leaked))
    over = f", over Ray with {args.workers} workers" if args.ray is not None else ""
    forked = f" (the first prepares, the rest run in {args.fork} forks)" if args.fork is not None else ""
    title = (
        f"sandbox-middleware run: {args.sessions} sessions, concurrency {args.concurrency}, "
        f"{args.commands} commands each{forked}, provider {provider}{over}"
    )
    # The verdict is in: from here a signal ends the report or the linger, never changes the exit code.
    with contextlib.suppress(KeyboardInterrupt, _Interrupted):
        print(
            table(
                title,
                result.run,
                result.points,
                peak=result.peak,
                held=result.held,
                orphans=orphans_row(result.orphans),
                workers=lines,
            ),
            flush=True,
        )
        if args.fork is not None:
            forks = f"forks made: {result.run.forks} ({args.fork} per session that prepared its state; counted in"
            print(f"{forks} sandboxes started)", flush=True)
        if result.alive:
            print(f"the provider still holds {len(result.alive)} sandbox(es): {', '.join(result.alive)}", flush=True)
        time.sleep(args.linger)  # keep exporting (over Ray: the workers keep serving /metrics)
    return verdict


def _reap_command(args: argparse.Namespace) -> int:
    if args.force and args.run is None:
        raise UsageError("argument --force: needs --run ID (force takes one run's sandboxes of live owners)")
    if args.config and args.provider:
        raise UsageError("give a config or --provider NAME, not both: the provider to search")
    if args.config:
        resolved, where = _resolve(args.config), f"config {args.config}"
    elif args.provider:
        resolved, where = resolve_config({"provider": {args.provider: {}}}), f"--provider {args.provider}"
    else:  # the provider a run without a config or --provider used
        resolved, where = resolve_config({"provider": DEFAULT_CONFIG["provider"]}), "the default config"
    provider = resolved.build(provider=_provider(resolved, where))
    try:
        reaped = anyio.run(partial(reap, provider, run_id=args.run, force=args.force, dry_run=args.dry_run))
    except SandboxError as exc:
        print(f"sandbox-middleware reap: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        anyio.run(provider.aclose)
    for entry in reaped:
        if entry.kind == "snapshot":
            state = "would delete" if args.dry_run else ("deleted" if entry.closed else f"NOT deleted ({entry.error})")
        else:
            state = "would close" if args.dry_run else ("closed" if entry.closed else f"NOT closed ({entry.error})")
        what = "  snapshot" if entry.kind == "snapshot" else ""
        print(f"{entry.sandbox_id}{what}  {state}  run {entry.run_id}  owner {entry.owner}  {entry.reason}")
    for left in reaped.unknown:
        what = "  snapshot" if left.kind == "snapshot" else ""
        unknown = f"liveness unknown: {left.reason}"
        print(f"{left.sandbox_id}{what}  left alone  run {left.run_id}  owner {left.owner}  {unknown}")
    failed = [entry for entry in reaped if not args.dry_run and not entry.closed]
    parts = []
    for kind, plural, verb in (("sandbox", "sandbox(es)", "closed"), ("snapshot", "snapshot(s)", "deleted")):
        chosen = [entry for entry in reaped if entry.kind == kind]
        unclosed = [entry for entry in failed if entry.kind == kind]
        alone = [entry for entry in reaped.unknown if entry.kind == kind]
        if kind == "snapshot" and not chosen and not alone:
            continue  # a run without snapshots reads as before
        part = f"{len(chosen) - len(unclosed)} {plural} {'found' if args.dry_run else verb}"
        part += f", {len(unclosed)} could not be {verb}" if unclosed else ""
        if alone:
            part += f", {len(alone)} left alone (owner liveness unknown here; --run ID --force takes them)"
        parts.append(part)
    print("; ".join(parts), file=sys.stderr)
    return EXIT_LEAKED if failed else EXIT_OK


def _exit_code(run: RunState, *, leaked: bool) -> int:
    if leaked:
        return EXIT_LEAKED
    if run.interrupted_by is not None:
        return 128 + run.interrupted_by
    return EXIT_SESSIONS_FAILED if run.failed else EXIT_OK
