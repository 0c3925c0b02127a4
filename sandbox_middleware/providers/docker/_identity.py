"""Who a DockerProvider sandbox runs as: a host uid of its own, never root, whatever the image says.

By default (``user="auto"``) each container runs as a uid (and a gid of the same number) leased
from the pool ``LocalProvider`` draws from (``_common/_uids.py``), claimed for the container so that
it stays the sandbox's after this process lets go, and released when the container is removed.
``user="UID[:GID]"`` (numbers, neither 0) makes every sandbox run as that one identity instead. The
image's ``USER`` is never used: names resolve through the image's own ``/etc/passwd``, which may
say anything (``USER nobody`` there may be uid 0). ``exec(user=...)`` takes only the sandbox's own
identity: there is no other inside the container to map to, and none is root.
"""

from __future__ import annotations

import re

import anyio.to_thread

from ..._errors import SandboxArgumentError
from .._common._uids import UID_BASE, UID_COUNT, UidLease, lease_directory, lease_uid, release_claim

__all__ = ["checked_user", "exec_user", "lease", "release", "release_blocking"]

_NUMERIC = re.compile(r"([0-9]{1,10})(?::([0-9]{1,10}))?")  # ASCII digits only: int() takes other scripts' digits too
_HIGHEST = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel


def _parsed(user: str) -> tuple[int, int] | None:
    match = _NUMERIC.fullmatch(user)
    if match is None:
        return None
    uid = int(match[1])
    gid = int(match[2]) if match[2] is not None else uid
    return (uid, gid) if 0 < uid <= _HIGHEST and 0 < gid <= _HIGHEST else None


def checked_user(user: str) -> tuple[int, int] | None:
    """The provider's ``user`` option: None for ``"auto"`` (a leased uid per sandbox), else its uid and gid."""
    if user == "auto":
        return None
    parsed = _parsed(user)
    if parsed is None:
        raise SandboxArgumentError(
            f"DockerProvider: user={user!r:.80} must be 'auto' (a host uid of its own per sandbox) or numbers "
            "'UID[:GID]', neither 0: a name resolves through the image's /etc/passwd, which may map it to root"
        )
    if any(UID_BASE <= number < UID_BASE + UID_COUNT for number in parsed):
        raise SandboxArgumentError(
            f"DockerProvider: user={user!r:.80} lies in the range sandboxes' own uids are leased from "
            f"({UID_BASE} + [0, {UID_COUNT})), where it would share a live sandbox's uid; pick one outside it"
        )
    return parsed


def exec_user(user: str | int | None, own: str, sandbox_id: str) -> str:
    """What ``exec(user=...)`` runs as: the sandbox's own ``"uid:gid"`` (``own``), spelled as None, its uid
    (an int or digits) or ``"uid:gid"``; any other user, root in any spelling included, is refused."""
    if user is None:
        return own
    if isinstance(user, bool) or not isinstance(user, str | int):
        raise SandboxArgumentError(f"user must be a name or a uid, not {user!r:.80}")
    uid = own.partition(":")[0]
    if str(user) in (own, uid):
        return own
    raise SandboxArgumentError(
        f"DockerProvider: sandbox {sandbox_id[:12]} runs every command as host uid:gid {own}, its own; exec("
        f"user={user!r:.80}) would need another identity (root included, in any spelling), which a sandbox "
        f"never has: pass user=None (or {uid}), and give the image what needs root at build time"
    )


async def lease() -> UidLease:
    """A host uid that no live sandbox holds (of this provider or any other, LocalProvider's too)."""
    return await anyio.to_thread.run_sync(lease_uid, lease_directory(), "DockerProvider")


async def release(uid: int, socket: str, containers: tuple[str, ...]) -> None:
    """Free ``uid``, claimed for one of ``containers`` on ``socket`` (its id, or its name), now removed."""
    await anyio.to_thread.run_sync(release_blocking, uid, socket, containers)


def release_blocking(uid: int, socket: str, containers: tuple[str, ...]) -> None:
    """``release``, blocking: where no event loop runs (the spare maker's removals, finalizers, exit)."""
    release_claim(lease_directory(), uid, socket, containers)
