"""LocalProvider's snapshots as records: their directories in base_dir, copies, descriptors, deletion.

A snapshot is a directory ``base_dir/<snapshot id>-<random>`` (``snap-`` and 13 hex digits: the length
of a sandbox id) holding its files and ``snapshot.json``, its record (the descriptor's fields, the
sandbox it came from, the paths and its layers), written last: a snapshot without a record is
half-made (its maker file names the process making it) or deleted. Its files are one of:

- read-only layers, mounts of the sandbox's own files frozen in place (``_layers.rotate``);
- a copy (``take``): ``tree/``, this process's files as the sandbox root held them (the working
  directory, or the paths asked for, at their place below the root), made while the sandbox runs
  (``_copies``), one file after another: not as of one moment.

Either is bounded by the sandbox's ``disk_gib``: more bytes than that, or more entries than its
tmpfs holds (``entry_bound``), is refused (``SandboxSnapshotError``). A fork's record names its
snapshot; ``delete_snapshot`` removes the record at once (no listing shows it, no descriptor is
accepted) and the files once no sandbox of base_dir names it (the last fork's close, or the next
sweep): a reference count kept on disk, under a ``flock`` of the snapshot's directory (shared while a
fork is made, exclusive to remove it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._errors import SandboxSnapshotError, SandboxSnapshotNotFoundError, SandboxValueError
from ..._protocol import SandboxSnapshot
from .._common._limits import Budget
from ._copies import DIRECTORY, copy_names
from ._records import (
    directories_of,
    drop_maker,
    read_record,
    remove_box,
    scan,
    write_maker,
    write_private,
)
from ._transfers import open_directory

__all__ = [
    "MAX_LAYERS",
    "SNAPSHOT_ID",
    "SNAPSHOT_RECORD",
    "TREE",
    "abandon",
    "delete",
    "held",
    "keep",
    "listed",
    "locked",
    "release",
    "retired",
    "source_of",
    "take",
]

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{13}")
SNAPSHOT_RECORD = "snapshot.json"
TREE = "tree"  # a copied snapshot's one layer (``take``)
_LAYER = re.compile(r"layer-[0-9]{1,3}")  # a rotated snapshot's layers: read-only mounts
MAX_LAYERS = 16  # a sandbox whose files are this many layers deep is copied instead (overlayfs's options fit a page)
_FIELDS = ("snapshot_id", "provider", "created", "size_bytes", "metadata")  # a record's descriptor


def take(
    base: Path,
    root: Path,
    selections: Sequence[tuple[tuple[str, ...], str]],
    limit: int | None,
    metadata: Mapping[str, str],
    source: str,
) -> SandboxSnapshot:
    """A new snapshot of the sandbox whose files are at ``root``: each ``(parts, path as given)`` of
    ``selections`` (``()``: the whole root), copied to its place in the tree (blocking)."""
    snapshot_id = f"snap-{uuid.uuid4().hex[:13]}"
    chosen: list[tuple[tuple[str, ...], str]] = []
    for parts, path in sorted(selections):  # a path inside another one chosen is in it already
        if not any(parts[: len(kept)] == kept for kept, _ in chosen):
            chosen.append((parts, path))
    write_maker(base, snapshot_id)  # first: killed from here on, the next sweep removes what is left
    outer: Path | None = None
    try:
        outer = Path(tempfile.mkdtemp(prefix=f"{snapshot_id}-", dir=base))
        os.mkdir(outer / TREE, 0o700)
        budget = Budget(limit)
        for parts, path in chosen:
            with (
                open_directory(root, parts[:-1], path) as src,
                open_directory(outer / TREE, parts[:-1], path, create=True) as dst,
            ):
                if not parts:
                    names = os.listdir(src)
                else:
                    try:
                        os.stat(parts[-1], dir_fd=src, follow_symlinks=False)
                    except FileNotFoundError:
                        raise SandboxSnapshotError(f"snapshot path {path!r} does not exist in the sandbox") from None
                    names = [parts[-1]]
                copy_names(src, dst, names, budget)
        snapshot = SandboxSnapshot(snapshot_id, "local", time.time(), budget.copied, dict(metadata))
        keep(outer, snapshot, source, [path for _, path in chosen], [(TREE, os.geteuid())])
        return snapshot
    except BaseException:
        abandon(base, snapshot_id, outer)
        raise


def keep(outer: Path, snapshot: SandboxSnapshot, source: str, paths: list[str], layers: list[tuple[str, int]]) -> None:
    """Write the snapshot's record (last: from here on it exists) and drop its maker file."""
    record = {
        **snapshot.to_dict(),
        "source": source,
        "paths": paths,
        "layers": [{"name": name, "uid": owner} for name, owner in layers],
    }
    write_private(outer, SNAPSHOT_RECORD, json.dumps(record).encode())
    drop_maker(outer)


def abandon(base: Path, snapshot_id: str, outer: Path | None) -> None:
    """Remove a half-made snapshot; what cannot be removed, the next sweep finds by its maker file."""
    if outer is None:
        drop_maker(base / snapshot_id)
    else:
        remove_box(outer, False, [])  # drops the maker once nothing is left


def _not_found(snapshot: SandboxSnapshot, base: Path, why: str, provider: str) -> SandboxSnapshotNotFoundError:
    return SandboxSnapshotNotFoundError(
        f"provider {provider!r}: no snapshot {snapshot.snapshot_id!r:.80} in {base} ({why}); take a new one (a "
        "snapshot is used by a provider of the directory that took it, LocalProvider's base_dir or DockerProvider's "
        "on the daemon's host, with its descriptor unchanged)"
    )


def _find(base: Path, snapshot: object, provider: str) -> tuple[Path, dict[str, Any]]:
    """The directory of ``snapshot`` in base_dir and its record, its descriptor checked against it."""
    if not isinstance(snapshot, SandboxSnapshot):
        raise SandboxValueError(f"a snapshot must be a SandboxSnapshot, not {type(snapshot).__name__}")
    if snapshot.provider != provider:
        raise _not_found(snapshot, base, f"it was taken by provider {snapshot.provider!r}", provider)
    if not SNAPSHOT_ID.fullmatch(snapshot.snapshot_id):  # never a path: '../', '/', NUL never reach one
        raise _not_found(snapshot, base, "an id of its snapshots is snap- and 13 hex digits", provider)
    found = directories_of(base, snapshot.snapshot_id)
    try:
        record = read_record(found[0], os.geteuid(), SNAPSHOT_RECORD) if len(found) == 1 else None
    except (OSError, ValueError, RecursionError):
        record = None
    if record is None:
        raise _not_found(snapshot, base, "never taken there, or deleted", provider)
    if {name: record.get(name) for name in snapshot.to_dict()} != snapshot.to_dict():
        raise _not_found(snapshot, base, "the descriptor does not match the snapshot's record", provider)
    return found[0], record


@contextlib.contextmanager
def locked(outer: Path, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """``outer``'s ``flock`` (a snapshot's directory, or a sandbox's), held in the block; without ``wait``,
    yields False at once when another holds it."""
    fd = os.open(outer, DIRECTORY)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(base: Path, snapshot: SandboxSnapshot, provider: str) -> Iterator[list[tuple[Path, int]]]:
    """The layers of ``snapshot`` (checked; top first, each with the uid owning its files), kept from
    deletion until the fork made of it has its record."""
    outer, _ = _find(base, snapshot, provider)
    with locked(outer, exclusive=False):
        _, record = _find(base, snapshot, provider)  # deleted while we waited for the lock?
        yield _layers(outer, record, snapshot, base, provider)


def source_of(base: Path, snapshot: SandboxSnapshot, provider: str) -> str:
    """What ``snapshot`` (checked) was taken of, as its maker recorded it (LocalProvider: the sandbox id)."""
    return str(_find(base, snapshot, provider)[1].get("source", ""))


def _layers(
    outer: Path, record: Mapping[str, Any], snapshot: SandboxSnapshot, base: Path, provider: str
) -> list[tuple[Path, int]]:
    """The layers a snapshot's record names (a copy's one tree when it names none), each there."""
    named = record.get("layers", [{"name": TREE, "uid": os.geteuid()}])
    layers = []
    for entry in named if isinstance(named, list) and 0 < len(named) <= MAX_LAYERS else [None]:
        name, owner = (entry.get("name"), entry.get("uid")) if isinstance(entry, dict) else (None, None)
        if not (name == TREE or (isinstance(name, str) and _LAYER.fullmatch(name))) or type(owner) is not int:
            raise _not_found(snapshot, base, "its record names no layers a snapshot has", provider)
        if name != TREE and os.stat(outer / name).st_dev == os.stat(outer).st_dev:
            raise _not_found(snapshot, base, "its files, kept in memory, are gone (a reboot, or unmounted)", provider)
        layers.append((outer / name, owner))
    return layers


def _referenced(base: Path, snapshot_id: str) -> bool:
    return any(record.get("snapshot") == snapshot_id for _, _, record in scan(base))


def _remove_unreferenced(base: Path, outer: Path, snapshot_id: str) -> list[str]:
    """Remove the tree of a snapshot without a record once no sandbox of base_dir names it (under its lock)."""
    try:
        with locked(outer, exclusive=True):
            if not os.path.lexists(outer) or (outer / SNAPSHOT_RECORD).exists() or _referenced(base, snapshot_id):
                return []  # removed by another fork's close meanwhile, or still in use
            return remove_box(outer, False, [])
    except FileNotFoundError:  # removed before we could lock it
        return []


def delete(base: Path, snapshot: SandboxSnapshot, provider: str) -> list[str]:
    """Delete ``snapshot``: its record at once, its tree once no fork names it; what could not be removed."""
    outer, _ = _find(base, snapshot, provider)
    with locked(outer, exclusive=True):
        _find(base, snapshot, provider)  # deleted by another process meanwhile?
        os.unlink(outer / SNAPSHOT_RECORD)
    return _remove_unreferenced(base, outer, snapshot.snapshot_id)


def release(base: Path, snapshot_id: str) -> list[str]:
    """A fork of ``snapshot_id`` is gone: its snapshot's tree goes too if it was deleted and no fork is left."""
    outers = directories_of(base, snapshot_id)
    return [failure for outer in outers for failure in _remove_unreferenced(base, outer, snapshot_id)]


def retired(base: Path) -> list[str]:
    """The ids of deleted snapshots whose tree is still in base_dir (no record, no maker file)."""
    found = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base):
            snapshot_id = entry.name[:18]
            if (
                SNAPSHOT_ID.fullmatch(snapshot_id)
                and entry.name[18:19] == "-"
                and entry.is_dir(follow_symlinks=False)
                and not os.path.lexists(Path(entry.path) / SNAPSHOT_RECORD)
            ):
                found.add(snapshot_id)
    return sorted(found - {name.removesuffix(".maker") for name in os.listdir(base) if name.endswith(".maker")})


def listed(base: Path, metadata: Mapping[str, str]) -> list[SandboxSnapshot]:
    """The snapshots of base_dir whose metadata holds every item of ``metadata``."""
    found = []
    for _, _, record in scan(base, SNAPSHOT_RECORD, SNAPSHOT_ID):
        try:
            snapshot = SandboxSnapshot.from_dict({name: record.get(name) for name in _FIELDS})
        except SandboxValueError:
            continue
        if all(snapshot.metadata.get(key) == value for key, value in metadata.items()):
            found.append(snapshot)
    return sorted(found, key=lambda snapshot: snapshot.created)
