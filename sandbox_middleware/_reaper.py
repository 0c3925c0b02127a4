"""``reap``: close the sandboxes, and delete the snapshots, that a finished or crashed run, or a dead
owner, left behind (and the snapshots past their expiry)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.lowlevel

from ._core import innermost
from ._errors import SandboxError
from ._owner import RUN_KEY, Owner, expired
from ._protocol import SandboxListing, SandboxProvider, SandboxSnapshot, SupportsSandboxList, SupportsSandboxSnapshot
from ._sandbox import close_shielded

__all__ = ["ReapReport", "ReapedSandbox", "UnreapedSandbox", "reap"]

logger = logging.getLogger("sandbox_middleware")
_T = TypeVar("_T")


Kind = Literal["sandbox", "snapshot"]


@dataclass(frozen=True)
class ReapedSandbox:
    """One sandbox (or, with ``kind="snapshot"``, one snapshot: ``sandbox_id`` is then its snapshot id and
    ``closed`` says it was deleted) the reaper chose: why, and whether closing it worked (``dry_run``
    closes nothing)."""

    sandbox_id: str
    run_id: str
    owner: str
    reason: str
    closed: bool
    error: str | None = None
    kind: Kind = "sandbox"


@dataclass(frozen=True)
class UnreapedSandbox:
    """One sandbox (or snapshot, by ``kind``) the reaper left alone because its owner's liveness cannot be
    told from this process (another host, boot or PID namespace): ``reason`` says which. ``force=True``
    with its ``run_id`` takes it."""

    sandbox_id: str
    run_id: str
    owner: str
    reason: str
    kind: Kind = "sandbox"


class ReapReport(list[ReapedSandbox]):
    """What ``reap`` returns: the sandboxes and snapshots it chose (a list of ``ReapedSandbox``, each closed
    or deleted or not, ``kind`` telling which), and in ``unknown`` those it left alone, their owners of
    unknown liveness (``UnreapedSandbox``)."""

    def __init__(self, reaped: Iterable[ReapedSandbox], unknown: Iterable[UnreapedSandbox] = ()) -> None:
        super().__init__(reaped)
        self.unknown: tuple[UnreapedSandbox, ...] = tuple(unknown)


@runtime_checkable
class _SweepsLeftovers(Protocol):
    """A provider that can remove what dead processes left half-made (``LocalProvider``)."""

    async def sweep_leftovers(self, *, dry_run: bool = False) -> tuple[list[ReapedSandbox], list[UnreapedSandbox]]: ...


def _judge(metadata: Mapping[str, str], run_id: str | None, force: bool, now: float) -> tuple[str | None, str | None]:
    """(why to close it, or None; why it is left alone as of unknown liveness, or None)."""
    run = metadata.get(RUN_KEY)
    if run is None or (run_id is not None and run != run_id):
        return None, None  # not made through OwnershipMiddleware (never ours to judge), or another run
    if run_id is not None and force:
        return "run reaped by request (force)", None
    if expired(metadata, now):  # only snapshots carry an expiry: the provider ends a sandbox at its TTL
        return "expired (sandbox_middleware.expires is past)", None
    owner = Owner.from_metadata(metadata)
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
    """Close the sandboxes left behind, and delete the snapshots, reporting each by id.

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

    Where the provider takes snapshots (``SupportsSandboxSnapshot``), its snapshots are judged the
    same way from the stamp ``OwnershipMiddleware`` gave them, and deleted; and a snapshot of any run
    (of ``run_id``, with it) whose ``sandbox_middleware.expires`` is past is deleted whoever owns it.
    They are reported with ``kind="snapshot"``, after the sandboxes.
    """
    if not isinstance(provider, SupportsSandboxList):
        raise SandboxError(
            f"reap: provider {provider.name!r} cannot list its sandboxes (no SupportsSandboxList.list); "
            "reap needs a provider that can"
        )
    wanted = {RUN_KEY: run_id} if run_id is not None else None
    now = time.time()
    listed = await provider.list(metadata=wanted)
    chosen, unknown = _choose([(item, item.handle.sandbox_id, item.metadata) for item in listed], run_id, force, now)
    _warn_unknown(unknown, "sandbox(es)")
    reaped = await close_listed(provider, chosen, dry_run=dry_run, close_timeout_s=close_timeout_s)
    bottom = innermost(provider)
    if run_id is None and isinstance(bottom, _SweepsLeftovers):  # they belong to no run
        swept, unseen = await bottom.sweep_leftovers(dry_run=dry_run)
        reaped, unknown = [*reaped, *swept], [*unknown, *unseen]
    if isinstance(provider, SupportsSandboxSnapshot):
        snapshots = await provider.list_snapshots(metadata=wanted)
        marked = [(item, item.snapshot_id, item.metadata) for item in snapshots]
        chosen_snapshots, unknown_snapshots = _choose(marked, run_id, force, now)
        unknown_snapshots = [dataclasses.replace(entry, kind="snapshot") for entry in unknown_snapshots]
        _warn_unknown(unknown_snapshots, "snapshot(s)")
        reaped += await _delete_listed(provider, chosen_snapshots, dry_run=dry_run, timeout_s=close_timeout_s)
        unknown += unknown_snapshots
    return ReapReport(reaped, unknown)


def _choose(
    items: Iterable[tuple[_T, str, Mapping[str, str]]], run_id: str | None, force: bool, now: float
) -> tuple[list[tuple[_T, str]], list[UnreapedSandbox]]:
    """Of ``(item, its id, its metadata)``: those to reap, with why, and those left alone as of unknown liveness."""
    chosen, unknown = [], []
    for item, item_id, metadata in items:
        reason, unsure = _judge(metadata, run_id, force, now)
        if reason is not None:
            chosen.append((item, reason))
        elif unsure is not None:
            owner = Owner.from_metadata(metadata)
            unknown.append(UnreapedSandbox(item_id, metadata.get(RUN_KEY, ""), str(owner or "unknown"), unsure))
    return chosen, unknown


def _warn_unknown(unknown: list[UnreapedSandbox], what: str) -> None:
    if unknown:
        logger.warning(
            "reap: left %d %s alone, their owners' liveness unknown here (reap with the run id and "
            "force takes them): %s",
            len(unknown),
            what,
            "; ".join(f"{entry.sandbox_id} (run {entry.run_id}: {entry.reason})" for entry in unknown),
        )


async def close_listed(
    provider: SandboxProvider,
    chosen: Iterable[tuple[SandboxListing, str]],
    *,
    dry_run: bool = False,
    close_timeout_s: float = 60.0,
) -> list[ReapedSandbox]:
    """Close each listed sandbox (with the reason it was chosen) one by one; report each."""
    marked = [(listing, listing.handle.sandbox_id, listing.metadata, reason) for listing, reason in chosen]

    async def close(listing: SandboxListing) -> None:
        await close_shielded(provider, listing.handle, close_timeout_s)

    return await _remove_each(marked, close, "sandbox", dry_run)


async def _delete_listed(
    provider: SupportsSandboxSnapshot,
    chosen: Iterable[tuple[SandboxSnapshot, str]],
    *,
    dry_run: bool,
    timeout_s: float,
) -> list[ReapedSandbox]:
    """Delete each chosen snapshot (shielded, bounded) one by one; report each."""
    marked = [(snapshot, snapshot.snapshot_id, snapshot.metadata, reason) for snapshot, reason in chosen]

    async def delete(snapshot: SandboxSnapshot) -> None:
        with anyio.CancelScope(shield=True), anyio.fail_after(timeout_s):
            await provider.delete_snapshot(snapshot)

    return await _remove_each(marked, delete, "snapshot", dry_run)


async def _remove_each(
    chosen: Iterable[tuple[_T, str, Mapping[str, str], str]],
    remove: Callable[[_T], Awaitable[None]],
    kind: Kind,
    dry_run: bool,
) -> list[ReapedSandbox]:
    """``remove`` each of ``(item, its id, its metadata, why)`` in turn (none with ``dry_run``); report each,
    a failure as the entry's ``error``."""
    reaped = []
    for item, item_id, metadata, reason in chosen:
        owner = Owner.from_metadata(metadata)
        entry = ReapedSandbox(item_id, metadata.get(RUN_KEY, ""), str(owner or "unknown"), reason, False, kind=kind)
        if not dry_run:
            try:
                await remove(item)
            except (SandboxError, TimeoutError, OSError) as exc:
                entry = dataclasses.replace(entry, error=f"{type(exc).__name__}: {exc}")
                logger.warning("reap: could not remove %s %s: %s", kind, entry.sandbox_id, entry.error)
            else:
                entry = dataclasses.replace(entry, closed=True)
        reaped.append(entry)
        await anyio.lowlevel.checkpoint()
    return reaped
