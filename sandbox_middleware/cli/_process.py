"""One process's share of a ``run`` (the whole run, or one Ray worker's): build the stack, run the
workload, close the orphans of lost create responses, and report as plain, picklable data."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from .._config import ResolvedStack, resolve_config
from .._errors import SandboxImageNotFoundError, UsageError
from .._protocol import SandboxProvider, SupportsSandboxList, SupportsSandboxSnapshot
from .._reaper import ReapedSandbox, close_listed
from .._registry import middleware_registry
from ..middleware._ownership import OwnershipMiddleware
from ..middleware._release_accounting import ReleaseAccountingMiddleware
from ..providers.docker import DockerProvider
from ._export import Telemetry
from ._report import Points, draw, merge, progress, snapshot
from ._workload import CLOSE_TIMEOUT_S, RunState, workload

__all__ = [
    "ProcessResult",
    "RunOptions",
    "combine",
    "find_layer",
    "orphans_row",
    "run_process",
    "with_layer",
    "with_run_id",
]

T = TypeVar("T")


@dataclass(frozen=True)
class RunOptions:
    """What one process runs: its share of the sessions and concurrency, and the faults to inject."""

    sessions: int
    concurrency: int
    commands: int
    think_s: float = 0.0
    faults: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    timeline: bool = False
    """Record when each sandbox started and stopped (for the peak across a cluster's workers)."""
    image: str | None = None
    """``spec.image`` of every session's sandbox."""
    fork: int | None = None
    """Run each session's commands after its first in this many forks of its sandbox (``--fork``)."""


@dataclass
class ProcessResult:
    """What one process did, as plain data (a Ray worker sends it back to the driver)."""

    host: str
    pid: int
    run: RunState
    points: Points
    peak: int | None
    """The most sandboxes this process held at once; None without release accounting."""
    held: list[str]
    """Sandboxes the ledger still holds."""
    orphans: list[ReapedSandbox] | None
    """Lost-create orphans found (and closed, or not); None when they cannot be looked for."""
    alive: list[str] = field(default_factory=list)
    """With injected faults: sandboxes that really still exist (the injector's ground truth)."""
    held_snapshots: list[str] = field(default_factory=list)
    """Snapshots the ledger still holds (taken, never deleted: leaked)."""


def find_layer(provider: Any, cls: type[T]) -> T | None:
    """The first layer of ``cls`` in a stack, outermost first."""
    while provider is not None:
        if isinstance(provider, cls):
            return provider
        provider = getattr(provider, "inner", None)
    return None


def with_run_id(resolved: ResolvedStack, run_id: str) -> tuple[ResolvedStack, str | None]:
    """The stack with ``run_id`` given to its ownership layer, unless the config names one itself;
    and the run id in effect (None without an ownership layer)."""
    in_effect = None
    layers = []
    for layer in resolved.middleware:
        if issubclass(layer.cls, OwnershipMiddleware):
            if layer.options.get("run_id") is None:
                layer = dataclasses.replace(layer, options={**layer.options, "run_id": run_id})
            in_effect = in_effect or layer.options["run_id"]
        layers.append(layer)
    return dataclasses.replace(resolved, middleware=layers), in_effect


# Where a layer the command line adds goes: above the first layer of these names (else innermost).
_PLACE_ABOVE = {
    "warm_pool": ("metrics", "release_accounting", "retry", "admission", "ownership"),
    "admission": ("ownership",),
}


def with_layer(resolved: ResolvedStack, name: str, options: dict[str, Any]) -> ResolvedStack:
    """The stack with ``options`` set on its ``name`` layer (``warm_pool``, ``admission``), which is
    added where the recommended stack puts it if the config has none: the command line's ``--warm``
    and ``--max-create-rate``. The options are checked as a config's are."""
    layers = list(resolved.middleware)
    cls = middleware_registry.get(name)
    for index, layer in enumerate(layers):
        if layer.cls is cls:
            layers[index] = dataclasses.replace(layer, options={**layer.options, **options})
            return dataclasses.replace(resolved, middleware=layers)
    added = resolve_config({"provider": resolved.provider.name, "middleware": [{name: options}]}).middleware[0]
    above = [i for i, layer in enumerate(layers) if layer.name in _PLACE_ABOVE[name]]
    layers.insert(above[0] if above else len(layers), added)
    return dataclasses.replace(resolved, middleware=layers)


def run_process(
    resolved: ResolvedStack,
    options: RunOptions,
    telemetry: Telemetry,
    *,
    show_progress: bool = False,
    handle_signals: bool = True,
    provider: SandboxProvider | None = None,
) -> ProcessResult:
    """Build the stack (on ``provider``, the config's provider if already constructed), run
    ``options.sessions`` sessions through it, then close this process's orphans."""
    from ..testing import LOST_CREATE, FaultInjectingProvider

    rates = dict(options.faults)
    lost_create_rate = rates.pop(LOST_CREATE, 0.0)
    injector: list[FaultInjectingProvider] = []

    def wrap(provider: SandboxProvider) -> SandboxProvider:
        injector.append(
            FaultInjectingProvider(provider, seed=options.seed, failure_rates=rates, lost_create_rate=lost_create_rate)
        )
        return injector[0]

    provider = resolved.build(
        meter_provider=telemetry.meter_provider,
        tracer_provider=telemetry.tracer_provider,
        wrap_provider=wrap if options.faults else None,
        provider=provider,
    )
    accounting = find_layer(provider, ReleaseAccountingMiddleware)
    ownership = find_layer(provider, OwnershipMiddleware)
    can_look = accounting is not None and ownership is not None and isinstance(accounting.inner, SupportsSandboxList)
    orphans: list[ReapedSandbox] = []

    async def close_orphans() -> None:
        assert accounting is not None and ownership is not None
        found = await accounting.orphans(ownership.stamp)
        reason = "lost create response: the provider has it, no ledger holds it"
        orphans.extend(
            await close_listed(provider, [(listing, reason) for listing in found], close_timeout_s=CLOSE_TIMEOUT_S)
        )

    run = RunState(options.sessions, held_changes=[] if options.timeline else None)

    async def checked_workload() -> None:
        try:
            await _check_image(provider, options.image)
            _check_fork(provider, resolved, options.fork)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await provider.aclose()
            raise
        await workload(
            provider,
            run,
            concurrency=options.concurrency,
            commands=options.commands,
            think_s=options.think_s,
            image=options.image,
            fork=options.fork,
            background=progress(accounting) if show_progress else None,
            finish=close_orphans if can_look else None,
            handle_signals=handle_signals,
        )

    anyio.run(checked_workload)
    if show_progress:
        draw(run, accounting, final=True)
    return ProcessResult(
        host=socket.gethostname(),
        pid=os.getpid(),
        run=dataclasses.replace(run, leftovers=[]),
        points=snapshot(telemetry.table_reader),
        peak=accounting.peak_held if accounting is not None else None,
        held=[entry.sandbox_id for entry in accounting.held()] if accounting is not None else [],
        orphans=orphans if can_look else None,
        alive=sorted(injector[0].alive) if injector else [],
        held_snapshots=[entry.snapshot_id for entry in accounting.held_snapshots()] if accounting is not None else [],
    )


async def _check_image(provider: SandboxProvider, image: str | None) -> None:
    """An image the provider does not have is one usage error before any session, not every session's."""
    docker = find_layer(provider, DockerProvider)
    if image is None or docker is None:
        return
    try:
        await docker.check_image(image)
    except SandboxImageNotFoundError as exc:
        raise UsageError(f"argument --image: {exc}") from None


def _check_fork(provider: SandboxProvider, resolved: ResolvedStack, fork: int | None) -> None:
    """A stack that cannot fork is one usage error before any session, not every session's."""
    if fork is None or isinstance(provider, SupportsSandboxSnapshot):
        return
    named = resolved.provider
    raise UsageError(
        f"argument --fork: provider {named.name!r} ({named.cls.__name__}) takes no snapshots (it has no "
        "SupportsSandboxSnapshot), so its sandboxes cannot be forked; run without --fork, or on a provider "
        "that has the capability"
    )


def combine(results: Sequence[ProcessResult], sessions: int) -> ProcessResult:
    """One result for a run over several processes: counts summed, metrics merged, and the peak of
    sandboxes held at once across all of them (from every process's start / stop times)."""
    run = RunState(sessions)
    for part in results:
        run.ok += part.run.ok
        run.failed += part.run.failed
        run.cancelled += part.run.cancelled
        run.started += part.run.started
        run.forks += part.run.forks
        run.handed_out += part.run.handed_out
        run.interrupted_by = run.interrupted_by or part.run.interrupted_by
        for error, count in part.run.session_errors.items():
            run.session_errors[error] = run.session_errors.get(error, 0) + count
    run.held_changes = sorted(change for part in results for change in part.run.held_changes or ())
    peak = None
    if results and all(part.peak is not None for part in results):
        peak = max(_running_totals(run.held_changes), default=0)
    orphan_lists = [part.orphans for part in results]
    return ProcessResult(
        host=",".join(sorted({part.host for part in results})),
        pid=0,
        run=run,
        points=merge(part.points for part in results),
        peak=peak,
        held=[sandbox for part in results for sandbox in part.held],
        orphans=None if None in orphan_lists else [entry for part in orphan_lists if part for entry in part],
        alive=[sandbox for part in results for sandbox in part.alive],
        held_snapshots=[snapshot for part in results for snapshot in part.held_snapshots],
    )


def _running_totals(changes: Iterable[tuple[float, int]]) -> Iterable[int]:
    total = 0
    for _, delta in changes:
        total += delta
        yield total


def orphans_row(orphans: list[ReapedSandbox] | None) -> str:
    """The table's orphans row: found / reaped, and the ids."""
    if orphans is None:
        return "n/a (needs ownership and release_accounting layers and a provider that can list)"
    closed = [entry.sandbox_id for entry in orphans if entry.closed]
    text = f"{len(orphans)} / {len(closed)}"
    if orphans:
        text += ": " + ", ".join(entry.sandbox_id + ("" if entry.closed else " (NOT closed)") for entry in orphans)
    return text
