"""``sandbox-middleware``: run a rollout-shaped workload through a configured stack, or check a config."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ._config import ConfigError, load_config, resolve_config
from ._protocol import SandboxError, SandboxProvider, SandboxSpec
from ._release_accounting import ReleaseAccountingMiddleware
from ._sandbox import Sandbox

DEFAULT_CONFIG: dict[str, Any] = {
    "provider": {"local": {"isolation": "none"}},
    "middleware": [
        "tracing",
        "metrics",
        "release_accounting",
        {
            "retry": {
                "attempts": 5,
                "timeout": 120,
                "operations": ["create", "close"],
                "on": ["SandboxCreateError", "ConnectionError"],
                "budget": {"max_tokens": 100, "token_ratio": 0.1},
            }
        },
    ],
}
EXTRAS = {"otlp": "otlp", "prometheus": "prometheus"}
CLEANUP_ROUNDS = 5


class CommandFailedError(SandboxError):
    """A workload command exited non-zero."""


@dataclass
class _Run:
    sessions: int
    ok: int = 0
    failed: int = 0
    started: int = 0
    leftovers: list[Sandbox] = field(default_factory=list)
    session_errors: dict[str, int] = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandbox-middleware", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a rollout-shaped workload through a stack and print its telemetry")
    run.add_argument("config", nargs="?", help="YAML stack config (default: local provider, full recommended stack)")
    run.add_argument("--sessions", type=_positive, default=50, help="sessions to run (default 50)")
    run.add_argument("--concurrency", type=_positive, default=8, help="sessions at once (default 8)")
    run.add_argument("--commands", type=_non_negative, default=3, help="commands per session (default 3)")
    run.add_argument(
        "--export",
        choices=["none", "console", "otlp", "prometheus"],
        default="none",
        help="where metric data also goes (otlp uses the standard OTEL_EXPORTER_OTLP_* variables)",
    )
    run.add_argument("--prometheus-port", type=int, default=9464, help="port of /metrics with --export prometheus")
    run.add_argument("--prometheus-host", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)")
    run.add_argument("--linger", type=float, default=0.0, help="seconds to keep exporting after the run")
    run.add_argument("--faults", default="", help="inject provider faults, e.g. create=0.1,close=0.05,exec=0.01")
    run.add_argument("--seed", type=int, default=None, help="seed of the fault injector (printed when random)")
    run.add_argument("--verbose", action="store_true", help="also log a warning for every retry")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="draw a progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip
    check = sub.add_parser("check", help="validate a config and print the resolved stack, outermost first")
    check.add_argument("config")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "check":
            print(resolve_config(load_config(args.config)).describe())
            return 0
        return _run_command(args)
    except ConfigError as exc:
        print(f"sandbox-middleware: config error: {exc}", file=sys.stderr)
        return 2
    except _UsageError as exc:
        print(f"sandbox-middleware: {exc}", file=sys.stderr)
        return 2


class _UsageError(Exception):
    pass


def _telemetry(args: argparse.Namespace) -> tuple[Any, Any, Any, list[Any]]:
    """SDK meter and tracer providers for this run (never installed globally), and the table's reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        InMemoryMetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider

    table_reader = InMemoryMetricReader()
    readers: list[Any] = [table_reader]
    tracer_provider = TracerProvider()
    closers: list[Any] = []
    if args.export == "console":
        readers.append(
            PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout), export_interval_millis=60_000)
        )
    elif args.export == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise _UsageError(_missing_extra("otlp", exc)) from exc
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif args.export == "prometheus":
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server
        except ImportError as exc:
            raise _UsageError(_missing_extra("prometheus", exc)) from exc
        server, _ = start_http_server(args.prometheus_port, addr=args.prometheus_host)
        closers.append(server.shutdown)
        readers.append(PrometheusMetricReader())
        print(f"serving /metrics on http://{args.prometheus_host}:{args.prometheus_port}/metrics", file=sys.stderr)
    return MeterProvider(metric_readers=readers), tracer_provider, table_reader, closers


def _missing_extra(name: str, exc: ImportError) -> str:
    return (f"--export {name} needs the '{EXTRAS[name]}' extra ({exc.name} is not installed): "
            f"pip install 'llm-sandbox-middleware[{EXTRAS[name]}]'")  # fmt: skip


def _run_command(args: argparse.Namespace) -> int:
    from .testing import FaultInjectingProvider, parse_faults

    config = load_config(args.config) if args.config else DEFAULT_CONFIG
    resolved = resolve_config(config)
    try:
        rates = parse_faults(args.faults)
    except ValueError as exc:
        raise _UsageError(f"--faults: {exc}") from exc
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    injector: list[FaultInjectingProvider] = []

    def wrap(provider: SandboxProvider) -> SandboxProvider:
        injector.append(FaultInjectingProvider(provider, seed=seed, failure_rates=rates))
        return injector[0]

    meter_provider, tracer_provider, reader, closers = _telemetry(args)
    try:
        provider = resolved.build(
            meter_provider=meter_provider, tracer_provider=tracer_provider, wrap_provider=wrap if rates else None
        )
        where = f"config {args.config}" if args.config else "the built-in default config"
        print(f"stack from {where}:\n{resolved.describe()}", file=sys.stderr)
        if rates:
            print(f"injecting faults {rates} with seed {seed}", file=sys.stderr)
        if args.progress is None:
            args.progress = sys.stderr.isatty()
        _configure_logging(args.verbose, args.progress)
        run = _Run(args.sessions)
        accounting = _find_accounting(provider)
        anyio.run(_workload, provider, args, run, accounting)
        held = accounting.held() if accounting is not None else []
        print(_table(args, resolved.provider.name, run, reader, accounting, held))
        truly_alive = sorted(injector[0].alive) if injector else []
        if truly_alive:
            print(f"the provider still holds {len(truly_alive)} sandbox(es): {', '.join(truly_alive)}")
        if args.linger > 0:
            time.sleep(args.linger)
        return 1 if held or truly_alive else 0
    finally:
        meter_provider.shutdown()
        tracer_provider.shutdown()
        for close in closers:
            close()


def _find_accounting(provider: Any) -> ReleaseAccountingMiddleware | None:
    while provider is not None:
        if isinstance(provider, ReleaseAccountingMiddleware):
            return provider
        provider = getattr(provider, "inner", None)
    return None


async def _workload(
    provider: SandboxProvider, args: argparse.Namespace, run: _Run, accounting: ReleaseAccountingMiddleware | None
) -> None:
    with tempfile.TemporaryDirectory(prefix="sandbox-middleware-run-") as tmp:
        workdir = Path(tmp)
        source = workdir / "input.txt"
        source.write_text("rollout input\n" * 64)
        limiter = anyio.Semaphore(args.concurrency)

        async def session(number: int) -> None:
            async with limiter:
                await _session(provider, args.commands, source, workdir / f"result-{number}.txt", run)

        async with anyio.create_task_group() as tg:
            if args.progress:
                tg.start_soon(_progress, run, accounting)
            async with anyio.create_task_group() as sessions:
                for number in range(args.sessions):
                    sessions.start_soon(session, number)
            await _cleanup(run)
            tg.cancel_scope.cancel()
        if args.progress:
            _draw(run, accounting, final=True)
        await provider.aclose()


async def _session(provider: SandboxProvider, commands: int, source: Path, result: Path, run: _Run) -> None:
    sandbox = Sandbox(provider, SandboxSpec(), local_files={"input.txt": source})
    try:
        await sandbox.start()
        run.started += 1
        for step in range(commands):
            done = await sandbox.exec(f"echo step {step} >> result.txt && wc -c < input.txt >> result.txt")
            if done.return_code != 0:
                raise CommandFailedError(f"step {step} exited {done.return_code}: {done.stderr}")
        if commands:
            await sandbox.download("result.txt", result)
        await sandbox.stop()
        run.ok += 1
    except Exception as exc:
        run.failed += 1
        key = type(exc).__name__
        run.session_errors[key] = run.session_errors.get(key, 0) + 1
        if sandbox.started:
            run.leftovers.append(sandbox)


async def _cleanup(run: _Run) -> None:
    """Stop what a failed session could not, a few rounds, as an operator's cleanup pass would."""
    for _ in range(CLEANUP_ROUNDS):
        pending = [sandbox for sandbox in run.leftovers if sandbox.started]
        if not pending:
            return
        async with anyio.create_task_group() as tg:
            for sandbox in pending:
                tg.start_soon(_stop_quietly, sandbox)


async def _stop_quietly(sandbox: Sandbox) -> None:
    with contextlib.suppress(Exception):  # counted by the metrics layer; retried in the next round
        await sandbox.stop()


async def _progress(run: _Run, accounting: ReleaseAccountingMiddleware | None) -> None:
    while True:
        _draw(run, accounting)
        await anyio.sleep(0.2)


def _draw(run: _Run, accounting: ReleaseAccountingMiddleware | None, *, final: bool = False) -> None:
    done = run.ok + run.failed
    width = 30
    filled = width * done // max(run.sessions, 1)
    active = len(accounting.held()) if accounting is not None else "?"
    line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{run.sessions} sessions  ok {run.ok}  "
            f"failed {run.failed}  active {active}")  # fmt: skip
    _ProgressAwareHandler.bar = "" if final else line
    sys.stderr.write(_CLEAR_LINE + line + ("\n" if final else ""))
    sys.stderr.flush()


_CLEAR_LINE = "\r\033[K"


class _ProgressAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes log records above the progress bar: clear the bar's line, write the record, redraw it."""

    bar = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            self.stream.write(_CLEAR_LINE + message + "\n" + type(self).bar)
            self.flush()
        except Exception:
            self.handleError(record)


def _configure_logging(verbose: bool, progress: bool) -> None:
    """The program's logging: warnings of this package on stderr, above the progress bar.

    Retries are counted in the table; each one's warning is shown only with --verbose. stamina's own
    per-retry log line is turned off: RetryMiddleware logs every retry itself.
    """
    import stamina.instrumentation

    stamina.instrumentation.set_on_retry_hooks([])
    handler: logging.Handler = _ProgressAwareHandler(sys.stderr) if progress else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger("sandbox_middleware")
    package.addHandler(handler)
    package.setLevel(logging.WARNING)
    package.propagate = False
    logging.getLogger("sandbox_middleware.retry").setLevel(logging.WARNING if verbose else logging.ERROR)


def _points(reader: Any, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    return [
        point
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def _sum(reader: Any, name: str) -> float:
    return float(sum(point.value for point in _points(reader, name)))


def _percentiles(reader: Any, name: str) -> str:
    """p50 / p95 / max in ms from the histogram's buckets (linear within a bucket)."""
    points = _points(reader, name)
    count = sum(p.count for p in points)
    if not count:
        return "no samples"
    bounds = list(points[0].explicit_bounds)
    counts = [sum(p.bucket_counts[i] for p in points) for i in range(len(bounds) + 1)]
    low, high = min(p.min for p in points), max(p.max for p in points)

    def quantile(q: float) -> float:
        rank = q * count
        seen = 0
        for index, in_bucket in enumerate(counts):
            if in_bucket and seen + in_bucket >= rank:
                lower = bounds[index - 1] if index > 0 else low
                upper = bounds[index] if index < len(bounds) else high
                lower, upper = max(lower, low), min(upper, high)
                return float(lower + (upper - lower) * (rank - seen) / in_bucket)
            seen += in_bucket
        return float(high)

    return f"{quantile(0.5):.1f} / {quantile(0.95):.1f} / {high:.1f}  ({count} samples)"


def _table(args: argparse.Namespace, provider_name: str, run: _Run, reader: Any,
           accounting: ReleaseAccountingMiddleware | None, held: list[Any]) -> str:  # fmt: skip
    final_active = _sum(reader, "gym.sandbox.active")
    peak = str(accounting.peak_held) if accounting is not None else "n/a (no release_accounting)"
    failures: dict[tuple[str, str], float] = {}
    for point in _points(reader, "gym.sandbox.failure_total"):
        key = (str(point.attributes.get("operation")), str(point.attributes.get("error.type")))
        failures[key] = failures.get(key, 0) + point.value
    rows = [
        ("sessions ok / failed", f"{run.ok} / {run.failed}"),
        ("sandboxes started", str(run.started)),
        ("gym.sandbox.active peak / final", f"{peak} / {final_active:g}"),
        ("startup ms p50 / p95 / max", _percentiles(reader, "gym.sandbox.startup_duration_ms")),
        ("exec ms p50 / p95 / max", _percentiles(reader, "gym.sandbox.exec_duration_ms")),
        (
            "retries create / other",
            f"{_sum(reader, 'gym.sandbox.create_retry_total'):g} / {_sum(reader, 'gym.sandbox.retry_total'):g}",
        ),
        ("retries refused by budget", f"{_sum(reader, 'gym.sandbox.retry_throttled_total'):g}"),
        ("sandboxes still held", f"{len(held)}" + (f": {', '.join(h.sandbox_id for h in held)}" if held else "")),
    ]
    title = (f"sandbox-middleware run: {args.sessions} sessions, concurrency {args.concurrency}, "
             f"{args.commands} commands each, provider {provider_name}")  # fmt: skip
    width = max(len(label) for label, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    lines.append("failures by operation and error type:" if failures else "failures: none")
    for (operation, error), number in sorted(failures.items()):
        lines.append(f"  {operation:<9} {error:<50} {number:g}")
    if run.session_errors:
        lines.append(
            "failed sessions by error: " + ", ".join(f"{k} {v}" for k, v in sorted(run.session_errors.items()))
        )
    return "\n".join(lines)
