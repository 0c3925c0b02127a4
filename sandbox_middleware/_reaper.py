"""``reap``: close the sandboxes that a finished or crashed run, or a dead owner, left behind."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio.lowlevel

from ._core import innermost
from ._errors import SandboxError
from ._owner import RUN_KEY, Owner
from ._protocol import SandboxListing, SandboxProvider, SupportsSandboxList
from ._sandbox import close_shielded

__all__ = ["ReapReport", "ReapedSandbox", "UnreapedSandbox", "reap"]

logger = logging.getLogger("sandbox_middleware")


@dataclass(frozen=True)
class ReapedSandbox:
    """One sandbox the reaper chose: why, and whether closing it worked (``dry_run`` closes nothing)."""

    sandbox_id: str
    run_id: str
    owner: str
    reason: str
    closed: bool
    error: str | None = None


@dataclass(frozen=True)
class UnreapedSandbox:
    """One sandbox the reaper left alone because its owner's liveness cannot be told from this process
    (another host, boot or PID namespace): ``reason`` says which. ``force=True`` with its ``run_id`` takes it."""

    sandbox_id: str
    run_id: str
    owner: str
    reason: str


class ReapReport(list[ReapedSandbox]):
    """What ``reap`` returns: the sandboxes it chose (a list of ``ReapedSandbox``, each closed or not),
    and in ``unknown`` those it left alone, their owners of unknown liveness (``UnreapedSandbox``)."""

    def __init__(self, reaped: Iterable[ReapedSandbox], unknown: Iterable[UnreapedSandbox] = ()) -> None:
        super().__init__(reaped)
        self.unknown: tuple[UnreapedSandbox, ...] = tuple(unknown)


@runtime_checkable
class _SweepsLeftovers(Protocol):
    """A provider that can remove what dead processes left half-made (``LocalProvider``)."""

    async def sweep_leftovers(self, *, dry_run: bool = False) -> tuple[list[ReapedSandbox], list[UnreapedSandbox]]: ...


def _judge(listing: SandboxListing, run_id: str | None, force: bool) -> tuple[str | None, str | None]:
    """(why to close it, or None; why it is left alone as of unknown liveness, or None)."""
    run = listing.metadata.get(RUN_KEY)
    if run is None or (run_id is not None and run != run_id):
        return None, None  # not made through OwnershipMiddleware (never ours to judge), or another run
    if run_id is not None and force:
        return "run reaped by request (force)", None
    owner = Owner.from_metadata(listing.metadata)
    alive, why = owner.liveness() if owner is not None else (None, "no owner stamped")
    if alive is None:
        return None, why
    if alive:
        return None, None
    return (f"run {run_id} finished; owner {owner} gone" if run_id is not None else why), None


async def reap(
    provider: SandboxProvider,
    *,
    run_id: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    close_timeout_s: float = 60.0,
) -> ReapReport:
    """Close the sandboxes left behind, reporting each by id.

    A sandbox is reaped when its owner is found dead: by a process of the owner's host, boot and PID
    namespace, whose pid is gone or now names another process (see ``Owner.liveness``). With
    ``run_id``: that run's sandboxes of dead owners; ``force=True`` takes all of the run's, live
    owners' too. Without: the sandboxes, of any run, whose owner is dead. A sandbox of a live owner,
    of another run, or without ownership metadata is never touched; one whose owner's liveness cannot
    be told from here (another host, boot or PID namespace: a trainer in a container of the host's
    network has the host's hostname but pids of its own) is left alone unless forced, and reported
    in the result's ``unknown`` (and logged). Without ``run_id``, what dead processes left half-made
    is removed too, where the provider keeps such (``LocalProvider``: a sandbox directory, its mount
    and cgroups without a record). ``dry_run=True`` only lists. Each close is shielded
    and bounded by ``close_timeout_s``; a failed one is reported, not raised.
    """
    if not isinstance(provider, SupportsSandboxList):
        raise SandboxError(
            f"reap: provider {provider.name!r} cannot list its sandboxes (no SupportsSandboxList.list); "
            "reap needs a provider that can"
        )
    wanted = {RUN_KEY: run_id} if run_id is not None else None
    chosen, unknown = [], []
    for listing in await provider.list(metadata=wanted):
        reason, unsure = _judge(listing, run_id, force)
        if reason is not None:
            chosen.append((listing, reason))
        elif unsure is not None:
            owner = Owner.from_metadata(listing.metadata)
            run = listing.metadata.get(RUN_KEY, "")
            unknown.append(UnreapedSandbox(listing.handle.sandbox_id, run, str(owner or "unknown"), unsure))
    if unknown:
        logger.warning(
            "reap: left %d sandbox(es) alone, their owners' liveness unknown here (reap with the run id and "
            "force takes them): %s",
            len(unknown),
            "; ".join(f"{entry.sandbox_id} (run {entry.run_id}: {entry.reason})" for entry in unknown),
        )
    reaped = await close_listed(provider, chosen, dry_run=dry_run, close_timeout_s=close_timeout_s)
    bottom = innermost(provider)
    if run_id is None and isinstance(bottom, _SweepsLeftovers):  # they belong to no run
        swept, unseen = await bottom.sweep_leftovers(dry_run=dry_run)
        reaped, unknown = [*reaped, *swept], [*unknown, *unseen]
    return ReapReport(reaped, unknown)


async def close_listed(
    provider: SandboxProvider,
    chosen: Iterable[tuple[SandboxListing, str]],
    *,
    dry_run: bool = False,
    close_timeout_s: float = 60.0,
) -> list[ReapedSandbox]:
    """Close each listed sandbox (with the reason it was chosen) one by one; report each."""
    reaped = []
    for listing, reason in chosen:
        owner = Owner.from_metadata(listing.metadata)
        entry = ReapedSandbox(
            listing.handle.sandbox_id, listing.metadata.get(RUN_KEY, ""), str(owner or "unknown"), reason, False
        )
        if not dry_run:
            try:
                await close_shielded(provider, listing.handle, close_timeout_s)
            except (SandboxError, TimeoutError, OSError) as exc:
                entry = dataclasses.replace(entry, error=f"{type(exc).__name__}: {exc}")
                logger.warning("reap: could not close %s: %s", entry.sandbox_id, entry.error)
            else:
                entry = dataclasses.replace(entry, closed=True)
        reaped.append(entry)
        await anyio.lowlevel.checkpoint()
    return reaped
