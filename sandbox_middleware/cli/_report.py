"""What the ``run`` command shows: the progress bar, log lines above it, and the final table."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import anyio

from ..middleware._release_accounting import ReleaseAccountingMiddleware
from ._workload import RunState

__all__ = ["Points", "configure_logging", "draw", "merge", "progress", "snapshot", "table"]

_CLEAR_LINE = "\r\033[K"


def progress(accounting: ReleaseAccountingMiddleware | None) -> Callable[[RunState], Coroutine[Any, Any, None]]:
    """The progress bar's task: redraw every 0.2 s until cancelled."""

    async def redraw(run: RunState) -> None:
        while True:
            draw(run, accounting)
            await anyio.sleep(0.2)

    return redraw


def draw(run: RunState, accounting: ReleaseAccountingMiddleware | None, *, final: bool = False) -> None:
    width = 30
    filled = width * run.done // max(run.sessions, 1)
    active = len(accounting.held()) if accounting is not None else "?"
    line = (
        f"[{'#' * filled}{'.' * (width - filled)}] {run.done}/{run.sessions} sessions  ok {run.ok}  "
        f"failed {run.failed}  active {active}"
    )
    _ProgressAwareHandler.bar = "" if final else line
    sys.stderr.write(_CLEAR_LINE + line + ("\n" if final else ""))
    sys.stderr.flush()


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


def configure_logging(verbose: bool, progress: bool) -> None:
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


Points = dict[str, list[dict[str, Any]]]
"""A metrics snapshot: each instrument's data points as plain data (picklable, mergeable across workers)."""


def snapshot(reader: Any) -> Points:
    """The data points ``reader`` (an SDK metric reader) holds now, by instrument name."""
    data = reader.get_metrics_data()
    points: Points = {}
    for resource in json.loads(data.to_json(indent=None))["resource_metrics"] if data else ():
        for scope in resource["scope_metrics"]:
            for metric in scope["metrics"]:
                points.setdefault(metric["name"], []).extend(metric["data"]["data_points"])
    return points


def merge(snapshots: Iterable[Points]) -> Points:
    """One snapshot of several processes: counters then sum, histograms merge bucket by bucket."""
    merged: Points = {}
    for one in snapshots:
        for name, points in one.items():
            merged.setdefault(name, []).extend(points)
    return merged


def _sum(points: Points, name: str) -> float:
    return float(sum(point["value"] for point in points.get(name, ())))


def _percentiles(points: Points, name: str) -> str:
    """p50 / p95 / max in ms from the histogram's buckets (linear within a bucket)."""
    samples = [p for p in points.get(name, ()) if p["count"]]
    count = sum(p["count"] for p in samples)
    if not count:
        return "no samples"
    bounds = list(samples[0]["explicit_bounds"])
    counts = [sum(p["bucket_counts"][i] for p in samples) for i in range(len(bounds) + 1)]
    low, high = min(p["min"] for p in samples), max(p["max"] for p in samples)

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


def _by(points: Points, name: str, *attributes: str) -> dict[tuple[str, ...], float]:
    """The counter ``name`` summed per value of ``attributes``."""
    totals: dict[tuple[str, ...], float] = {}
    for point in points.get(name, ()):
        key = tuple(str(point["attributes"].get(attribute)) for attribute in attributes)
        totals[key] = totals.get(key, 0) + point["value"]
    return totals


def _snapshots(points: Points) -> str:
    """The snapshots row: how many were taken (timed by a metrics layer) and how many are held at the
    end (``gym.sandbox.snapshot.active`` of a release accounting layer): those are leaked."""
    taken = sum(point["count"] for point in points.get("gym.sandbox.snapshot.duration_ms", ()))
    held = _sum(points, "gym.sandbox.snapshot.active")
    hint = "sandbox-middleware reap [CONFIG | --provider NAME] --run ID"
    leaked = f" (leaked: delete them, or reap the run: {hint})" if held else ""
    return f"{taken} / {held:g}{leaked}"


def table(
    title: str,
    run: RunState,
    points: Points,
    *,
    peak: int | None,
    held: list[str],
    orphans: str,
    workers: Iterable[str] = (),
) -> str:
    """The operator's summary of the run, computed from the metrics the stack recorded.

    ``peak`` is the most sandboxes held at once (None without release accounting), ``held`` the ids
    still held, ``orphans`` the orphans row, ``workers`` one line per worker of a run over Ray.
    """
    final_active = _sum(points, "gym.sandbox.active")
    failures = _by(points, "gym.sandbox.failure_total", "operation", "error.type")
    retries = _by(points, "gym.sandbox.retry_total", "operation")
    close_retries = retries.pop(("close",), 0)
    rows = [
        ("sessions ok / failed", f"{run.ok} / {run.failed}"),
        ("sandboxes started", str(run.started)),
        ("gym.sandbox.active peak / final",
         f"{peak if peak is not None else 'n/a (no release_accounting)'} / {final_active:g}"),
        ("startup ms p50 / p95 / max", _percentiles(points, "gym.sandbox.startup_duration_ms")),
        ("exec ms p50 / p95 / max", _percentiles(points, "gym.sandbox.exec_duration_ms")),
        (
            "retries create / close / other",
            f"{_sum(points, 'gym.sandbox.create_retry_total'):g} / {close_retries:g} / {sum(retries.values()):g}",
        ),
        ("retries refused by budget", f"{_sum(points, 'gym.sandbox.retry_throttled_total'):g}"),
        ("sandboxes still held", f"{len(held)}" + (f": {', '.join(held)}" if held else "")),
        ("snapshots taken / still held", _snapshots(points)),
        ("orphans found / reaped", orphans),
    ]  # fmt: skip
    if run.interrupted_by is not None:
        title += f" -- INTERRUPTED by {run.interrupted_by.name}"
        rows.insert(1, ("sessions cancelled / not run", f"{run.cancelled} / {run.not_run}"))
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
    lines.extend(workers)
    return "\n".join(lines)
