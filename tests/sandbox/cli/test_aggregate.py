"""The table of a run over several workers: counts summed, histograms merged, the peak across all of them."""

from __future__ import annotations

import pickle
import re

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from sandbox_middleware.cli._process import ProcessResult, combine
from sandbox_middleware.cli._report import Points, snapshot, table
from sandbox_middleware.cli._workload import RunState


def _worker_points(startups: list[float], active: int) -> Points:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("sandbox_middleware")
    histogram = meter.create_histogram("gym.sandbox.startup_duration_ms", unit="ms")
    for value in startups:
        histogram.record(value)
    meter.create_up_down_counter("gym.sandbox.active").add(active)
    meter.create_counter("gym.sandbox.create_retry_total").add(len(startups))
    return snapshot(reader)


def _result(ok: int, changes: list[tuple[float, int]], startups: list[float], peak: int) -> ProcessResult:
    run = RunState(ok, ok=ok, started=ok, handed_out=ok, held_changes=changes)
    return ProcessResult("host", 1, run, _worker_points(startups, 0), peak, [], [])


def test_combine_sums_counts_merges_histograms_and_takes_the_cluster_peak() -> None:
    first = _result(2, [(0.0, 1), (1.0, 1), (2.0, -1), (4.0, -1)], [10.0, 20.0], peak=2)
    overlapping = _result(1, [(1.5, 1), (3.0, -1)], [3000.0], peak=1)
    later = _result(1, [(5.0, 1), (6.0, -1)], [40.0], peak=1)
    results = pickle.loads(pickle.dumps([first, overlapping, later]))  # as they come back from Ray workers

    combined = combine(results, sessions=4)
    assert (combined.run.ok, combined.run.started, combined.peak) == (4, 4, 3)  # 2 + 1 held at t=1.5
    out = table("t", combined.run, combined.points, peak=combined.peak, held=combined.held, orphans="0 / 0")
    assert "sessions ok / failed             4 / 0" in out
    assert "gym.sandbox.active peak / final  3 / 0" in out
    startup = re.search(r"startup ms p50 / p95 / max\s+(.*)", out)
    assert startup is not None and startup.group(1).endswith("/ 3000.0  (4 samples)")
    assert "retries create / close / other   4 / 0 / 0" in out


def test_combine_of_a_run_without_accounting_has_no_peak() -> None:
    result = _result(1, [(0.0, 1), (1.0, -1)], [5.0], peak=1)
    result.peak = None
    assert combine([result], sessions=1).peak is None


def test_the_table_counts_snapshots_taken_and_names_a_leak() -> None:
    """The snapshots row: taken (the snapshot histogram's samples), still held at the end (the ledger's
    gauge), which are leaked, with what to do."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("sandbox_middleware")
    taken = meter.create_histogram("gym.sandbox.snapshot.duration_ms", unit="ms")
    held = meter.create_up_down_counter("gym.sandbox.snapshot.active")
    for _ in range(3):
        taken.record(12.0)
        held.add(1)
    held.add(-2)
    run = RunState(1, ok=1, started=1, handed_out=1)
    out = table("t", run, snapshot(reader), peak=1, held=[], orphans="0 / 0")
    assert re.search(r"^snapshots taken / still held\s+3 / 1 \(leaked: delete them, or reap the run", out, re.M)
    held.add(-1)
    out = table("t", run, snapshot(reader), peak=1, held=[], orphans="0 / 0")
    assert re.search(r"^snapshots taken / still held\s+3 / 0$", out, re.M)
    assert re.search(r"^snapshots taken / still held\s+0 / 0$", table("t", run, {}, peak=1, held=[], orphans=""), re.M)
