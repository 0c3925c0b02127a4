"""``reap``: close the sandboxes that a finished or crashed run, or a dead owner, left behind."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import anyio.lowlevel

from ._errors import SandboxError
from ._owner import RUN_KEY, Owner
from ._protocol import SandboxListing, SandboxProvider, SupportsSandboxList
from ._sandbox import close_shielded

__all__ = ["ReapedSandbox", "reap"]

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


def _reason(listing: SandboxListing, run_id: str | None, force: bool) -> str | None:
    run = listing.metadata.get(RUN_KEY)
    if run is None:
        return None  # not made through OwnershipMiddleware: never ours to judge
    owner = Owner.from_metadata(listing.metadata)
    alive = owner.alive() if owner is not None else None
    if run_id is not None:
        if run != run_id:
            return None
        if force:
            return "run reaped by request (force)"
        if alive:
            return None
        return f"run {run_id} finished; owner {'gone' if alive is False else 'on another host'}"
    if alive is False:
        return f"owner {owner} is no longer alive"
    return None


async def reap(
    provider: SandboxProvider,
    *,
    run_id: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    close_timeout_s: float = 60.0,
) -> list[ReapedSandbox]:
    """Close the sandboxes left behind, reporting each by id.

    With ``run_id``: the sandboxes of that run whose owner is not alive (gone, or on another host
    where it cannot be checked); ``force=True`` takes the run's sandboxes of live owners too.
    Without: the sandboxes, of any run, whose owner is on this host and no longer alive. A sandbox
    of a live owner, of another run, or without ownership metadata is never touched.
    ``dry_run=True`` only lists. Each close is shielded and bounded by ``close_timeout_s``; a
    failed one is reported, not raised.
    """
    if not isinstance(provider, SupportsSandboxList):
        raise SandboxError(
            f"reap: provider {provider.name!r} cannot list its sandboxes (no SupportsSandboxList.list); "
            "reap needs a provider that can"
        )
    wanted = {RUN_KEY: run_id} if run_id is not None else None
    chosen = []
    for listing in await provider.list(metadata=wanted):
        reason = _reason(listing, run_id, force)
        if reason is not None:
            chosen.append((listing, reason))
    return await close_listed(provider, chosen, dry_run=dry_run, close_timeout_s=close_timeout_s)


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
