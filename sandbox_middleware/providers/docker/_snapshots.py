"""DockerProvider's snapshots: a sandbox's writable directories kept as an image, and sandboxes made from one.

A sandbox's root filesystem is read-only; everything it can change lies in its tmpfs directories, the
work directory and ``/tmp`` (``_container.py``), which a commit of its container does not see. A
snapshot is therefore an image of its own: the image the sandbox runs plus one layer holding the
archive of the paths asked for, below ``STATE`` (``work/...`` for the work directory's, ``tmp/...``
for ``/tmp``'s), made by committing a *build* container (created from that image, never started)
into which the archive was written. The sandbox's own container is not committed: its writable layer
holds nothing (its root is read-only), and Docker's commit would copy its config into the image,
``spec.env`` and labels included, which every container made from the image would inherit.

- **Labels are the record** (``SNAPSHOT`` its id, and its provider, daemon, creation time, size, the
  image it was taken of, its parts and their sizes, and ``snapshot(metadata=...)`` as
  ``_container.META`` + key, as a container carries ``spec.metadata``), and the image is tagged
  ``REPOSITORY:<id>``, so that ``docker image prune`` leaves it and any process finds it
  (``list_snapshots``). A descriptor is hostile input: it names no image; the image is looked up by
  the id's label, must carry that tag, and its labels must give back the descriptor exactly, or it is
  ``SandboxSnapshotNotFoundError``. Only such an image is deleted (by its image id, never pruning
  its parents).
- **Consistent as of one moment**: the sandbox is paused (the cgroup freezer; gVisor's own) while its
  paths are checked (``HEAD``: each a real directory or file, no symlink on the way, which nothing in
  the frozen sandbox can swap) and read; it is resumed (shielded) once the archive is written, before
  the commit. A sandbox its user paused stays paused.
- **What is kept**: directories, regular files, symlinks (as links, whatever they point to; nothing
  is read through one), hard links and FIFOs, with their permission bits (setuid and setgid dropped)
  and modification times; no owner (each fork's files are its own uid's), no device, no extended
  attribute, no process.
- **A sandbox made from one** is created from ``spec`` as any (its image must be the one the
  snapshot was taken of; a spare of its shape may serve it), and before it is handed out the archive
  is read from a *reader* container (created from the snapshot's image, never started, removed
  after) and written into its tmpfs directories through the archive API, every entry owned by its own
  uid (``_archive.owned_stream``: the image's own archive passed on with its headers' owners set, its
  data untouched: the entries were checked and rewritten when the snapshot was taken); the parent's
  work directory's part goes to the new sandbox's. The forks run their spec's image,
  not the snapshot's, so a snapshot can be deleted while they run.
- **Helpers** (the build and reader containers) carry the snapshot's labels and a deadline
  (``_ttl.EXPIRES``): removed by the call that made them, shielded, else by the TTL watchdog.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import re
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import anyio

from ..._errors import (
    SandboxArgumentError,
    SandboxError,
    SandboxSnapshotError,
    SandboxSnapshotNotFoundError,
)
from ..._protocol import SandboxSnapshot
from .._common._limits import Budget
from ._api import EngineAPI, EngineError
from ._archive import END, TarEntries, check_directory, check_named, located, owned_stream, padding
from ._container import META, Box, checked_metadata, label_keys
from ._ttl import EXPIRES

__all__ = ["REPOSITORY", "SNAPSHOT", "STATE", "Record", "Snapshots", "rooms"]

logger = logging.getLogger("sandbox_middleware")

SNAPSHOT = "sandbox_middleware.docker.snapshot"  # its id
_PROVIDER = SNAPSHOT + ".provider"
_DAEMON = SNAPSHOT + ".daemon"
_CREATED = SNAPSHOT + ".created"
_SIZE = SNAPSHOT + ".size"
_BASE = SNAPSHOT + ".base"  # the image id the sandbox ran
_PARTS = SNAPSHOT + ".parts"  # "work:BYTES,tmp:BYTES"
REPOSITORY = "sandbox-middleware/snapshot"
STATE = PurePosixPath("/.sandbox-middleware-snapshot")
_ID = re.compile(r"[0-9a-f]{32}")
_WORK, _TMP = "work", "tmp"
_KEPT = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE)
_ROOT = (0, 0)  # the owner of a snapshot's files in its image: each fork's are its own uid's
_BATCH = 1 << 20
_HELPER_S = 1800.0  # a helper container's deadline: the watchdog removes one its maker left
_REMOVE_S = 30.0  # how long a helper's removal is waited for (a big writable layer under load takes long)


@dataclass(frozen=True)
class Record:
    """What the daemon holds of one snapshot: its image, the image it was taken of, its parts' sizes."""

    snapshot: SandboxSnapshot
    image: str
    base: str
    parts: dict[str, int]


def _record_of(image: str, labels: Mapping[str, str], tags: Sequence[str], provider: str, daemon: str) -> Record | None:
    """The snapshot an image's labels and tags describe; None for one that is not a snapshot of this
    provider on this daemon (or whose labels do not parse)."""
    snapshot_id = labels.get(SNAPSHOT, "")
    tag = f"{REPOSITORY}:{snapshot_id}"
    if not _ID.fullmatch(snapshot_id) or not any(name.removeprefix("docker.io/") == tag for name in tags):
        return None
    if labels.get(_PROVIDER) != provider or labels.get(_DAEMON) != daemon:
        return None
    try:
        parts = {key: int(size) for key, _, size in (part.partition(":") for part in labels[_PARTS].split(",") if part)}
        snapshot = SandboxSnapshot(
            snapshot_id,
            provider,
            float(labels[_CREATED]),
            int(labels[_SIZE]),
            {key[len(META) :]: value for key, value in labels.items() if key.startswith(META)},
        )
    except (KeyError, ValueError, SandboxError):
        return None
    if not set(parts) <= {_WORK, _TMP}:
        return None
    return Record(snapshot, image, labels.get(_BASE, ""), parts)


@dataclass(frozen=True)
class _Target:
    """One path to snapshot: which writable directory (``_WORK``/``_TMP``), that directory, the components below."""

    key: str
    mount: PurePosixPath
    parts: tuple[str, ...]


def _targets(box: Box, paths: list[str] | None) -> list[_Target]:
    """The paths of ``snapshot(paths=...)`` (None: the work directory), each in a writable directory,
    without ``..``; a path below another one asked for is left to it."""
    targets = []
    for path in paths if paths is not None else [str(box.cwd)]:
        mount, parts = located(path, box.cwd, box.mounts, "snapshot path")
        targets.append(_Target(_WORK if mount == box.mounts[0] else _TMP, mount, parts))
    targets.sort(key=lambda target: (target.key, target.parts))
    kept: list[_Target] = []
    for target in targets:
        if not any(k.key == target.key and target.parts[: len(k.parts)] == k.parts for k in kept):
            kept.append(target)
    return kept


def rooms(host: Mapping[str, Any]) -> dict[str, int]:
    """The sizes of a container's tmpfs directories (by mount point) its ``HostConfig`` gives: a tmpfs
    volume's ``size=`` (Docker's), or a tmpfs mount's (Podman's); one without a size is not there."""
    options = {
        str(mount.get("Target")): str(
            (((mount.get("VolumeOptions") or {}).get("DriverConfig") or {}).get("Options") or {}).get("o", "")
        )
        for mount in host.get("Mounts") or []
    }
    options.update({str(target): str(text) for target, text in (host.get("Tmpfs") or {}).items()})
    found = {}
    for target, text in options.items():
        for option in text.split(","):
            if option.startswith("size=") and option[5:].isascii() and option[5:].isdigit():
                found[target] = int(option[5:])
    return found


async def _rewritten(
    entries: TarEntries, rename: Callable[[str], str], owner: tuple[int, int], sizes: Budget
) -> AsyncIterator[bytes]:
    """The entries of an archive the daemon made, renamed (``rename``), owned by ``owner``, with only
    what a snapshot keeps: directories, regular files, symlinks (their targets as they are), hard links
    (renamed alike), FIFOs; permission bits without setuid and setgid."""
    batch = bytearray()  # sent in batches: a write per entry made the daemon's PUT twice as slow
    while (info := await entries.next()) is not None:
        if len(batch) >= _BATCH:
            yield bytes(batch)
            batch.clear()
        name = rename(info.name)
        if info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
            continue
        if info.type not in _KEPT and info.type != tarfile.CONTTYPE:
            raise SandboxSnapshotError(f"the archive has an entry of a kind a snapshot cannot keep: {info.name!r:.200}")
        out = tarfile.TarInfo(name)
        regular = info.isreg()
        out.type = tarfile.REGTYPE if regular else info.type
        out.size = info.size if regular else 0
        out.mode = info.mode & 0o1777
        out.mtime = int(info.mtime)
        out.uid, out.gid = owner
        if info.type == tarfile.SYMTYPE:
            out.linkname = info.linkname
        elif info.type == tarfile.LNKTYPE:
            out.linkname = rename(info.linkname)
        batch += out.tobuf(format=tarfile.PAX_FORMAT)
        sizes.entry()
        sizes.took(info.size if regular else 0)
        if regular:
            async for piece in entries.data():
                batch += piece
            batch += padding(info.size)
    yield bytes(batch + END)


def _renamer(source: str, prefix: Sequence[str]) -> Callable[[str], str]:
    """Names of an archive whose entries start with the component ``source``: that component replaced by
    the components ``prefix``. A name that does not start so, or has an empty, ``.`` or ``..``
    component, is refused."""

    def rename(name: str) -> str:
        parts = name.split("/")
        if parts[0] != source or any(part in ("", ".", "..") for part in parts[1:]):
            raise SandboxSnapshotError(f"the daemon's archive has an entry outside {source!r}: {name!r:.200}")
        return "/".join([*prefix, *parts[1:]])

    return rename


def _directories(names: Sequence[str]) -> list[bytes]:
    """Tar entries of the directories ``names[:1]``, ``names[:2]``... (made root's, 0755)."""
    records = []
    for depth in range(1, len(names) + 1):
        info = tarfile.TarInfo("/".join(names[:depth]))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
        records.append(info.tobuf(format=tarfile.PAX_FORMAT))
    return records


class Snapshots:
    """The snapshots of one provider (its ``name``) on the daemon ``api`` speaks to (``daemon``: its id)."""

    def __init__(self, api: EngineAPI, provider: str, daemon: str, watch: Callable[[], None], freeze: bool) -> None:
        self._api = api
        self._freeze = freeze  # Podman's archive API sees a paused container's tmpfs mounts empty
        self._provider = provider
        self._daemon = daemon
        self._watch = watch  # starts the TTL watchdog, which removes a helper left behind

    # --- taking one -------------------------------------------------------------------------------

    async def take(
        self, box: Box, base: str, paths: list[str] | None, metadata: dict[str, str], sizes: Mapping[str, int]
    ) -> SandboxSnapshot:
        """A snapshot of ``paths`` (None: the work directory) of the sandbox ``box``, which runs image ``base``,
        labelled ``metadata`` (checked strings; their keys are checked here as label keys); the files of each
        writable directory no more bytes than its size in ``sizes`` (``rooms``), where it has one."""
        targets = _targets(box, paths)
        wanted = label_keys(metadata, "snapshot metadata")
        snapshot_id = uuid.uuid4().hex
        labels = {
            SNAPSHOT: snapshot_id,
            _PROVIDER: self._provider,
            _DAEMON: self._daemon,
            _BASE: base,
            **{META + key: value for key, value in wanted.items()},
        }
        build = await self._helper(base, f"sandbox-snapshot-{snapshot_id[:12]}-build", labels)
        image = None
        try:
            parts: dict[str, Budget] = {}
            async with self._frozen(box.container):
                for target in targets:
                    part = parts.setdefault(target.key, Budget(sizes.get(str(target.mount)), "disk_gib or tmp_mib"))
                    await self._archive(box.container, target, build, part)
            # Labels known once the archive is written, as Dockerfile instructions (Podman's commit ignores a
            # config's; Docker applies both): values of digits, dots, colons and commas only.
            computed = {
                _CREATED: repr(time.time()),
                _SIZE: str(sum(part.copied for part in parts.values())),
                _PARTS: ",".join(f"{key}:{part.copied}" for key, part in parts.items()),
                EXPIRES: "",  # the build container's, which the image would inherit otherwise
            }
            changes = [f'LABEL {key}="{value}"' for key, value in computed.items()]
            params: dict[str, str | list[str]] = {
                "container": build,
                "repo": REPOSITORY,
                "tag": snapshot_id,
                "pause": "false",
                "changes": changes,
            }
            what = f"commit snapshot {snapshot_id[:12]}"
            reply = await self._api.call("POST", "/commit", what, params=params, body={})  # Podman's needs one
            image = str(reply.json()["Id"])
            record = await self._found(snapshot_id)
            if record is None:
                raise SandboxSnapshotError(
                    f"DockerProvider: snapshot {snapshot_id[:12]} was committed but is not found"
                )
            return record.snapshot
        except BaseException:
            if image is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(30), contextlib.suppress(SandboxError):
                    await self._remove_image(image, what)
            raise
        finally:
            await self._remove_helper(build)

    @contextlib.asynccontextmanager
    async def _frozen(self, container: str) -> AsyncIterator[None]:
        """The sandbox paused for the block (a sandbox already paused, by its user, stays so); not where
        the archive API would then see its writable directories empty (Podman)."""
        paused = False
        if self._freeze:
            what = f"pause sandbox {container[:12]} for a snapshot"
            paused = (await self._api.call("POST", f"/containers/{container}/pause", what, ok=(409,))).status_code < 400
        try:
            yield
        finally:
            if paused:
                with anyio.CancelScope(shield=True), anyio.fail_after(60):
                    await self._api.call(
                        "POST", f"/containers/{container}/unpause", f"resume {container[:12]} after a snapshot"
                    )

    async def _archive(self, container: str, target: _Target, build: str, sizes: Budget) -> None:
        """Copy ``target`` of the (frozen) sandbox ``container`` into the build container, below ``STATE``:
        checked first, each component a real directory and the path itself no symlink; its bytes added to
        ``sizes``."""
        archive = f"/containers/{container}/archive"
        full = target.mount.joinpath(*target.parts)
        for depth in range(1, len(target.parts) + 1):
            path = str(target.mount.joinpath(*target.parts[:depth]))
            head = await self._api.call(
                "HEAD", archive, f"check snapshot path {path!r}", params={"path": path}, ok=(404,)
            )
            if head.status_code == 404:
                raise SandboxSnapshotError(f"DockerProvider: snapshot path {str(full)!r} is not in the sandbox")
            header = head.headers.get("X-Docker-Container-Path-Stat")
            if depth < len(target.parts):
                check_directory(header, str(full), path)
            else:
                check_named(header, str(full))
        names = [STATE.name, target.key, *target.parts]
        rename = _renamer(full.name, names)
        what = f"snapshot {str(full)!r} of sandbox {container[:12]}"
        async with self._api.stream("GET", archive, what, params={"path": str(full)}) as reply:
            entries = TarEntries(reply.aiter_raw(), f"the daemon's archive of {str(full)!r}")
            content = _leading(_directories(names[:-1]), _rewritten(entries, rename, _ROOT, sizes))
            await self._api.call("PUT", f"/containers/{build}/archive", what, params={"path": "/"}, content=content)

    # --- finding, listing, deleting --------------------------------------------------------------

    async def find(self, snapshot: object) -> Record:
        """The daemon's record of ``snapshot``: an image this provider labelled, whose labels give back
        the descriptor exactly; else ``SandboxSnapshotNotFoundError``."""
        if not isinstance(snapshot, SandboxSnapshot):
            raise SandboxArgumentError(f"from_snapshot must be a SandboxSnapshot, not {type(snapshot).__name__}")
        record = None
        if snapshot.provider == self._provider and _ID.fullmatch(snapshot.snapshot_id):
            record = await self._found(snapshot.snapshot_id)
        if record is None or record.snapshot != snapshot:
            raise SandboxSnapshotNotFoundError(
                f"DockerProvider: no snapshot {snapshot.snapshot_id!r:.80} of provider {snapshot.provider!r:.40} "
                f"matches this descriptor on the daemon at {self._api.socket} (never taken there, taken by another "
                "provider or daemon, deleted, or the descriptor was changed); take a new snapshot"
            )
        return record

    async def _found(self, snapshot_id: str) -> Record | None:
        records = await self._images(f"{SNAPSHOT}={snapshot_id}")
        return records[0] if len(records) == 1 else None

    async def _images(self, label: str) -> builtins.list[Record]:
        """The snapshots among the images with ``label``: one filter (Podman's images find none for two)."""
        params = {"filters": json.dumps({"label": [label]})}
        reply = await self._api.call("GET", "/images/json", "list snapshot images", params=params)
        records = []
        for image in reply.json():
            record = _record_of(
                str(image.get("Id")),
                image.get("Labels") or {},
                image.get("RepoTags") or (),
                self._provider,
                self._daemon,
            )
            if record is not None:
                records.append(record)
        return records

    async def listed(self, metadata: Mapping[str, str] | None) -> builtins.list[SandboxSnapshot]:
        """This provider's snapshots on its daemon (taken by any process) whose metadata has all of ``metadata``."""
        wanted = checked_metadata(metadata if metadata is not None else {}, "metadata")
        records = await self._images(SNAPSHOT)
        return [
            record.snapshot
            for record in sorted(records, key=lambda record: record.snapshot.created)
            if all(record.snapshot.metadata.get(key) == value for key, value in wanted.items())
        ]

    async def delete(self, snapshot: object) -> None:
        """Remove the image of ``snapshot`` (found as ``find`` finds it); its forks run on."""
        record = await self.find(snapshot)
        await self._remove_image(record.image, f"delete snapshot {record.snapshot.snapshot_id[:12]}")

    async def _remove_image(self, image: str, what: str) -> None:
        reply = await self._api.call(
            "DELETE", f"/images/{image}", what, params={"force": "true", "noprune": "true"}, ok=(404,)
        )
        if reply.status_code == 404:
            raise SandboxSnapshotNotFoundError(f"DockerProvider: {what}: its image is gone (deleted meanwhile)")

    # --- making a sandbox from one ---------------------------------------------------------------

    def check_fits(self, record: Record, image_id: str, image: str, sizes: Mapping[str, int | None]) -> None:
        """Refuse a fork of another image than the snapshot's, or whose writable directories (``sizes``:
        bytes, None unbounded) cannot hold its parts."""
        if image_id != record.base:
            raise SandboxSnapshotError(
                f"DockerProvider: snapshot {record.snapshot.snapshot_id[:12]} was taken of a sandbox of image "
                f"{record.base[:19]}, and spec.image {image!r} is {image_id[:19]}: a sandbox from a snapshot runs the "
                "image the snapshot was taken of (its root filesystem); give the spec that image"
            )
        for key, size in record.parts.items():
            room = sizes[key]
            if room is not None and size > room:
                raise SandboxSnapshotError(
                    f"DockerProvider: snapshot {record.snapshot.snapshot_id[:12]} holds {size} bytes of "
                    f"{'the work directory' if key == _WORK else '/tmp'}, more than the new sandbox's {room} "
                    f"({'disk_gib' if key == _WORK else 'tmp_mib'}); give it more room"
                )

    async def restore(
        self, record: Record, container: str, mounts: Mapping[str, PurePosixPath], owner: tuple[int, int]
    ) -> None:
        """Write the snapshot's parts into the writable directories ``mounts`` (by key) of the started
        ``container``, every entry owned by ``owner``."""
        snapshot_id = record.snapshot.snapshot_id
        reader = await self._helper(
            record.image, f"sandbox-snapshot-{snapshot_id[:12]}-read-{uuid.uuid4().hex[:6]}", {}
        )
        try:
            for key in record.parts:
                what = f"restore snapshot {snapshot_id[:12]} into {container[:12]}:{mounts[key]}"
                params = {"path": f"{STATE / key}/."}  # its entries, named as below it (no renaming)
                async with self._api.stream("GET", f"/containers/{reader}/archive", what, params=params) as reply:
                    content = owned_stream(reply.aiter_raw(), owner, f"the archive of snapshot {snapshot_id[:12]}")
                    target = {"path": str(mounts[key]), "noOverwriteDirNonDir": "true"}
                    await self._api.call(
                        "PUT", f"/containers/{container}/archive", what, params=target, content=content
                    )
        except EngineError as exc:
            if exc.status == 404 and "No such image" in exc.message:
                raise SandboxSnapshotNotFoundError(f"DockerProvider: snapshot {snapshot_id[:12]} was deleted") from exc
            if "no space left on device" in exc.message:
                raise SandboxSnapshotError(
                    f"DockerProvider: snapshot {snapshot_id[:12]} does not fit the new sandbox's writable "
                    f"directories ({exc.message}); give it more disk_gib or tmp_mib"
                ) from exc
            raise
        finally:
            await self._remove_helper(reader)

    # --- helper containers -----------------------------------------------------------------------

    async def _helper(self, image: str, name: str, labels: Mapping[str, str]) -> str:
        """A container of ``image`` that is never started (its entrypoint does not exist), with no network:
        only its root filesystem is used, through the archive API. Its deadline lets the watchdog remove it."""
        self._watch()
        body: dict[str, Any] = {
            "Image": image,
            "Entrypoint": [str(STATE / "never-started")],
            "Cmd": [],
            "Env": [],
            "Labels": {**labels, EXPIRES: repr(time.time() + _HELPER_S)},
            "NetworkDisabled": True,
            "HostConfig": {"NetworkMode": "none", "LogConfig": {"Type": "none", "Config": {}}},
        }
        what = f"create a snapshot's helper container {name}"
        try:
            reply = await self._api.call("POST", "/containers/create", what, params={"name": name}, body=body)
        except EngineError as exc:
            if exc.status == 404:
                raise SandboxSnapshotNotFoundError(
                    f"DockerProvider: {what}: its image is gone ({exc.message})"
                ) from exc
            raise
        return str(reply.json()["Id"])

    async def _remove_helper(self, container: str) -> None:
        """Remove a helper container, shielded and bounded; one left (the daemon failed) the watchdog removes."""
        what = f"remove helper container {container[:12]}"
        with anyio.CancelScope(shield=True), anyio.move_on_after(_REMOVE_S) as bound:
            try:
                await self._api.call(
                    "DELETE", f"/containers/{container}", what, params={"force": "true", "v": "true"}, ok=(404,)
                )
            except SandboxError as exc:
                logger.warning("DockerProvider: %s: %s (the TTL watchdog removes it)", what, exc)
        if bound.cancelled_caught:
            logger.warning(
                "DockerProvider: %s: not done within %g s (the daemon goes on, else the watchdog)", what, _REMOVE_S
            )


async def _leading(records: Sequence[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for record in records:
        yield record
    async for chunk in rest:
        yield chunk
