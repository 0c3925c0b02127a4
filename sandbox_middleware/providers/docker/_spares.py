"""DockerProvider's spares: one container of the shape last asked for, created and started ahead.

Most of a Docker create is the daemon's: the container's create and start (runc, the init, the
keep-alive shell), 100-300 ms on a loaded machine, the floor of any client. ``DockerSpares``
(``_common/_spares.py``) keeps one container of the shape the last create asked for running, made
in the background by the provider's own create path (everything a create makes it of), so the
next create of that shape takes it: two inspects and a rename, then ``spec.files``.

- **The shape is the whole create body** (image, env, limits, mounts, the host pools' bounds:
  ulimits ``nofile``/``nproc``, the pty mount, network, ports, runtime, labels with
  ``spec.metadata``) and the TCP buffers' bound written after start, all but the TTL's deadline and
  the host uid (``shape_of``): a spare is made with the caller's labels and env already, since
  Docker cannot change them after create, and is never given to a create whose body differs in
  anything else. A spec with an ``entrypoint`` has no spare: its main process would run before its
  create.
- **Its own host uid**, leased and claimed like any sandbox's (``_identity.py``: for its name, then
  its id, which a take's rename leaves alone); a taken spare's uid is the sandbox's, freed at its
  close. An untaken spare's removal here (``remove``, ``sweep``) frees it once the daemon removed
  it; one the watchdog removes is freed by the next lease that finds its container gone (404).
- **Not the caller's until taken.** Labels are immutable, so a spare carries ``SPARE`` (its maker)
  and ``SPARE_UNTIL`` (when it goes stale) besides the sandbox's, and the name ``sandbox-<id>-spare``.
  A take renames it ``sandbox-<id>-at-<ms>[-until-<ms>]`` (``_ttl.taken_name``): when it was taken
  and its TTL's deadline, which the watchdog, ``list`` and ``connect`` read there. Only the Engine
  API renames a container, so the code inside cannot forge either state. ``list`` (and so ``reap``)
  never shows an untaken spare.
- **Stale spares are never handed out**: not within ``TAKE_MARGIN_S`` of ``SPARE_UNTIL`` (the
  provider's ``spare_ttl_s`` after its make), nor when its image's name now names another image.
- **Removed**: at ``aclose`` (shielded, bounded), when the provider is collected or at interpreter
  exit, at ``SPARE_UNTIL`` by the TTL watchdog (whether or not its maker lives), and, when its maker
  died, by the next provider made on the same daemon (``sweep``: ``sandbox-middleware reap`` makes one).
  Its work directory on the host (``_files.py``) goes with it: removed with it here, else by the
  watchdog or the next sweep of work directories no container names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ..._owner import Owner
from .._common._spares import Spares
from ._container import HostDir, Made, Plan, create_body, leased_uid
from ._files import Files
from ._identity import release_blocking
from ._ttl import SPARE, SPARE_UNTIL, deadline_of, is_spare

__all__ = ["DockerSpares", "Shape", "Spare", "shape_of", "spare_body", "sweep"]

logger = logging.getLogger("sandbox_middleware")

TAKE_MARGIN_S = 10.0  # at most (half the spare's TTL if less): the watchdog never removes a spare being taken
SUFFIX = "-spare"  # of an untaken spare's name
Adapt = Callable[[dict[str, Any]], dict[str, Any]]  # a create body as the daemon is given it
_ANY_UID = (-1, -1)  # the owner in a shape's body: each container's uid is leased for it, so no shape has one


@dataclass(frozen=True)
class Shape:
    """What makes two creates' containers interchangeable: the canonical JSON of their create body
    without the TTL's deadline or a leased uid, and of their TCP buffers' bound (``key``), and the plan
    a spare of it is made from."""

    key: str
    plan: Plan = dataclasses.field(compare=False, hash=False)


@dataclass(frozen=True)
class Spare:
    """One spare container: as made (its id, uid; ``built.name`` ends in ``SUFFIX``), its name without
    ``SUFFIX``, the image id it runs, when it was made and when it goes stale (seconds since the epoch)."""

    built: Made
    name: str
    image: str
    made: float
    until: float


def shape_of(plan: Plan, fixed_user: tuple[int, int] | None, adapt: Adapt) -> Shape | None:
    """The shape of a create by a provider whose sandboxes run as ``fixed_user`` (None: a uid leased per
    sandbox, left out of the shape), its body as ``adapt`` gives it to the daemon (``_daemons.Daemon.adapt``:
    the runtime, Podman's ulimits and mounts); None for a spec with an entrypoint, which no spare serves."""
    if plan.entrypoint is not None:
        return None
    body = adapt(create_body(dataclasses.replace(plan, deadline=None), fixed_user or _ANY_UID, fixed_user is None))
    return Shape(json.dumps({"body": body, "tcp_bytes": plan.tcp_bytes}, sort_keys=True), plan)


def spare_body(
    plan: Plan, until: float, owner: tuple[int, int], leased: bool, files: HostDir | None = None
) -> dict[str, Any]:
    """The create body of a spare of ``plan`` running as ``owner`` (``leased``: its own uid; ``files``: its
    work directory on the host): the sandbox's, without a deadline, with its maker (this process) and when
    it goes stale."""
    body = create_body(dataclasses.replace(plan, deadline=None), owner, leased, files)
    body["Labels"] = {**body["Labels"], SPARE: json.dumps(Owner.current().metadata()), SPARE_UNTIL: repr(until)}
    return body


class DockerSpares(Spares[Shape, Spare]):
    """DockerProvider's spare: handed out only well before it goes stale."""

    who = "DockerProvider"

    def usable(self, item: Spare) -> bool:
        return time.time() < item.until - min(TAKE_MARGIN_S, (item.until - item.made) / 2)


def _client(socket: str, version: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=socket), base_url=f"http://docker/v{version}", timeout=30)


def remove(socket: str, version: str, files: Files | None, spare: Spare) -> None:
    """Force-remove a spare and its volumes, then free its uid and remove its work directory on the host
    (``files``'s; blocking; any thread, a finalizer, interpreter exit)."""
    try:
        with _client(socket, version) as client:
            _removed(client, socket, spare.built.container, spare.built.name, spare.built.uid)
        if files is not None and spare.built.files is not None:
            files.remove(spare.built.files)
    except httpx.HTTPError as exc:  # its SPARE_UNTIL makes the watchdog remove it (and a lease then frees its uid)
        logger.warning("DockerProvider: spare container %s not removed (%s); the watchdog will", spare.name, exc)


def _removed(client: httpx.Client, socket: str, container: str, name: str, uid: int | None) -> None:
    """Force-remove ``container`` (created as ``name``) and its volumes; once removed (or being removed:
    Docker's 409), free ``uid``, claimed for it. Another failure raises ``httpx.HTTPStatusError``."""
    reply = client.delete(f"/containers/{container}", params={"force": "true", "v": "true"})
    if reply.status_code != 404 and not (reply.status_code == 409 and "already in progress" in reply.text):
        reply.raise_for_status()
    if uid is not None:
        release_blocking(uid, socket, (container, name))


def sweep(socket: str, version: str) -> None:
    """Remove the untaken spares on the daemon at ``socket`` whose maker is gone or that are stale (blocking)."""
    try:
        with _client(socket, version) as client:
            reply = client.get("/containers/json", params={"all": "1", "filters": json.dumps({"label": [SPARE]})})
            reply.raise_for_status()
            for container in reply.json():
                labels, name = container.get("Labels") or {}, str((container.get("Names") or [""])[0])
                if is_spare(labels, name) and _abandoned(labels, name):
                    try:  # one the daemon refuses to remove (its uid kept) does not stop the others'
                        _removed(client, socket, str(container["Id"]), name.lstrip("/"), leased_uid(labels))
                    except httpx.HTTPStatusError as exc:
                        logger.debug("DockerProvider: spare %s not swept: %s", name, exc)
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # the watchdog removes them at SPARE_UNTIL
        logger.debug("DockerProvider: dead processes' spares not swept: %s", exc)


def _abandoned(labels: dict[str, str], name: str) -> bool:
    """Whether an untaken spare is stale, or its maker (on this host) is no longer alive."""
    with contextlib.suppress(ValueError):
        deadline = deadline_of(labels, name)
        if deadline is not None and deadline <= time.time():
            return True
    try:
        maker = Owner.from_metadata(json.loads(labels[SPARE]))
    except (ValueError, TypeError):
        return False
    return maker is not None and maker.alive() is False
