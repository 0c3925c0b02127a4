"""``run --ray``: the sessions spread over Ray actors, each building the stack from the same config.

Each actor runs its share of the sessions and of the concurrency in its own process with its own
telemetry, and sends back a ``ProcessResult``; the driver aggregates them into one table. With
``--export prometheus`` every actor serves /metrics on a free port, and ``--prometheus-sd-file``
lists them for Prometheus's ``file_sd_configs`` (one Prometheus scrapes every worker). With
``--export otlp`` every actor exports to the collector named by the driver's OTEL_* variables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._config import ResolvedStack
from .._errors import UsageError
from ._export import start_telemetry
from ._process import ProcessResult, RunOptions, run_process

__all__ = ["run_on_ray"]

_CONNECT_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 5.0


class _Worker:
    """One Ray actor: telemetry of its own, then its share of the run."""

    def __init__(self, export: str, metrics_host: str) -> None:
        self.telemetry = start_telemetry(export, metrics_host, 0)  # port 0: a free one, listed by the driver

    def where(self) -> tuple[str, int, int | None]:
        return socket.gethostname(), os.getpid(), self.telemetry.metrics_port

    def run(self, resolved: ResolvedStack, options: RunOptions) -> ProcessResult:
        return run_process(resolved, options, self.telemetry, handle_signals=False)  # signals are Ray's

    def shutdown(self) -> list[str]:
        return self.telemetry.shutdown()


def _import_ray(address: str) -> Any:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        # A cluster on loopback (`ray start --head --node-ip-address 127.0.0.1`): without this Ray
        # rewrites the address to this machine's network address, where nothing listens.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as exc:
        raise UsageError(
            f"argument --ray: needs the 'ray' extra ({exc.name} is not installed): "
            "pip install 'llm-sandbox-middleware[ray]'"
        ) from exc
    return ray


def _check_reachable(address: str) -> None:
    """Fail fast on a host:port where no Ray head listens (ray.init would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a ray:// client address: Ray resolves it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise UsageError(
            f"argument --ray: cannot connect to a Ray cluster at {address}: {exc.strerror or exc}; start one "
            "with `ray start --head --node-ip-address 127.0.0.1 --port PORT` or name its address (host:port)"
        ) from exc


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


Report = Callable[[list[ProcessResult], list[str], int], int]
"""Prints the table from the workers' results, one line per worker and how many workers were lost
(their sandboxes are left to ``reap``), lingers; returns the exit code."""


def run_on_ray(
    args: argparse.Namespace, resolved: ResolvedStack, options: RunOptions, run_id: str | None, report: Report
) -> int:
    """Run the sessions on ``args.workers`` actors and ``report`` them (the actors serve /metrics
    until it returns); return the exit code ``report`` returned."""
    ray = _import_ray(args.ray)
    _check_reachable(args.ray)
    env = {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}
    try:
        ray.init(address=args.ray, runtime_env={"env_vars": env} if env else None, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(
            f"argument --ray: cannot connect to a Ray cluster at {args.ray!r}: {exc}; start one with "
            "`ray start --head --node-ip-address 127.0.0.1` or name its address (host:port)"
        ) from exc
    try:
        return _run(ray, args, resolved, options, run_id, report)
    finally:
        ray.shutdown()


def _run(
    ray: Any, args: argparse.Namespace, resolved: ResolvedStack, options: RunOptions, run_id: str | None, report: Report
) -> int:
    count = min(args.workers, options.sessions)
    worker_cls = ray.remote(num_cpus=1, max_restarts=0)(_Worker)
    actors = [worker_cls.remote(args.export, args.prometheus_host) for _ in range(count)]
    try:
        where = ray.get([actor.where.remote() for actor in actors], timeout=_CONNECT_TIMEOUT_S)
        for index, (host, pid, port) in enumerate(where):
            metrics = f", /metrics on http://{args.prometheus_host}:{port}/metrics" if port else ""
            print(f"worker {index}: pid {pid} on {host}{metrics}", file=sys.stderr, flush=True)
        if args.prometheus_sd_file:
            _write_sd_file(Path(args.prometheus_sd_file), args.prometheus_host, where, run_id)
        shares = zip(_shares(options.sessions, count), _shares(max(options.concurrency, count), count), strict=True)
        refs = [
            actor.run.remote(resolved, dataclasses.replace(options, sessions=sessions, concurrency=concurrency,
                                                           seed=options.seed + index, timeline=True))
            for index, (actor, (sessions, concurrency)) in enumerate(zip(actors, shares, strict=True))
        ]  # fmt: skip
        results, lines, lost = [], [], 0
        for index, ref in enumerate(refs):
            host, pid, _ = where[index]
            try:
                result: ProcessResult = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, UsageError):  # the worker's check at start (a missing image)
                    raise exc.cause from None
                raise
            except ray.exceptions.RayActorError as exc:
                lost += 1
                lines.append(
                    f"worker {index}  pid {pid} on {host}: LOST ({type(exc).__name__}); its sandboxes "
                    f"stay until {_reap_hint(args, resolved, run_id)}"
                )
                continue
            results.append(result)
            lines.append(
                f"worker {index}  pid {pid} on {host}: sessions ok / failed {result.run.ok} / {result.run.failed}, "
                f"started {result.run.started}, peak held {result.peak}, still held {len(result.held)}, "
                f"orphans {len(result.orphans or ())}"
            )
        code = report(results, lines, lost)
        for actor in actors:
            with contextlib.suppress(Exception):  # a lost worker has nothing left to flush
                for note in ray.get(actor.shutdown.remote(), timeout=10):
                    print(note, file=sys.stderr)
        return code
    finally:
        for actor in actors:
            ray.kill(actor)


def _reap_hint(args: argparse.Namespace, resolved: ResolvedStack, run_id: str | None) -> str:
    """What closes a lost worker's sandboxes: ``reap`` of this run, or (no ownership layer) only their TTL."""
    if run_id is None:
        return (
            "their TTL: this stack has no ownership layer, so reap cannot tell them from other sandboxes "
            "(add ownership to the config's middleware to make a run reapable)"
        )
    where = args.config or f"--provider {resolved.provider.name}"
    return f"sandbox-middleware reap {where} --run {run_id} closes them (or their TTL)"


def _write_sd_file(path: Path, host: str, where: list[tuple[str, int, int | None]], run_id: str | None) -> None:
    """Prometheus file_sd targets, one per worker, labelled with its index, pid and the run id."""
    groups = [
        {"targets": [f"{host}:{port}"], "labels": {"worker": str(index), "pid": str(pid), "run_id": run_id or ""}}
        for index, (_, pid, port) in enumerate(where)
        if port
    ]
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(groups, indent=2))
    partial.replace(path)  # Prometheus never reads half a file
    print(f"wrote {len(groups)} scrape target(s) to {path}", file=sys.stderr)
