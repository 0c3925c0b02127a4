"""LocalProvider's snapshots without a copy, and forks: a sandbox's files as read-only layers.

A snapshot of the whole of a bwrap sandbox's files (``rotate``), with the sandbox frozen and no
command running: what the sandbox writes to (box/ itself, or the upper layer of its overlay) and the
layers below it become the snapshot's ``layer-0``, ``layer-1``, ... (top first): read-only private
mounts of those trees in its directory, kept alive by the mounts (the sandbox's tmpfs outlives the
sandbox). The sandbox goes on in a new tmpfs of its ``disk_gib``, an overlay of those layers mounted
on box/, which the sandbox's view (a slave of box/, ``_mounts.share``) shows at once. No copy, as of
one moment; in memory (tmpfs), so a reboot loses it. Its files are counted (``measure``) for
``size_bytes`` and its bound; a later snapshot of the same files counts only the directories written
since (``SIZES``). How a sandbox's files are made is its ``View`` (``view.json`` beside box/),
changed under the sandbox directory's ``flock`` (exclusive; an upload holds it shared).

A fork's files (``fill``) are an overlay of the snapshot's layers (or copied tree) mounted on the
fork's box/ while it runs, each layer mounted read-only in the fork's directory (idmapped where its
files are another uid's), its writes in the fork's own tmpfs: a fork costs no copy and what it writes
counts against its own ``disk_gib``; where this process may not mount (not root), the tree is copied.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..._protocol import SandboxSnapshot
from .._common._limits import Budget
from ._cgroups import CgroupBackend
from ._copies import DIRECTORY, MAX_DEPTH, copy_names, too_deep
from ._mounts import clone_readonly, is_mount_point, mount_overlay, mount_tmpfs, mounted_at, unmount, userns_mapping
from ._records import PINNED, ROTATING, VIEW, read_record, write_maker, write_private
from ._snapshots import MAX_LAYERS, TREE, abandon, keep, locked
from ._transfers import open_directory

__all__ = ["CgroupFreezer", "Freezer", "Layer", "View", "fill", "measure", "read_view", "repair", "rotate", "uploading"]

_NUMBERED = r"-[0-9]{1,3}"
_SIZES = "sizes.json"  # beside box/, and in a snapshot's directory: what each directory held (``measure``)


class Freezer(Protocol):
    """How one sandbox's processes are held still while its files become a layer."""

    def frozen(self) -> contextlib.AbstractContextManager[bool]:
        """Hold them still for the block; yields whether they are (False: the caller copies)."""
        ...

    def busy(self) -> bool:
        """Whether one of them could still write into the files after they are frozen (a command running)."""
        ...

    def thaw(self) -> None:
        """Let them run again (left frozen by a snapshot's maker since killed)."""
        ...


@dataclass(frozen=True)
class CgroupFreezer:
    """LocalProvider's: the sandbox's cgroups (``groups``) frozen by ``cgroups``; a command is busy."""

    cgroups: CgroupBackend
    groups: Sequence[Path]

    def frozen(self) -> contextlib.AbstractContextManager[bool]:
        return self.cgroups.frozen(self.groups)

    def busy(self) -> bool:
        return self.cgroups.commands_running(self.groups)

    def thaw(self) -> None:
        self.cgroups.thaw(self.groups)


@dataclass(frozen=True)
class Layer:
    """One read-only layer under a sandbox's files (a fork's, or what a snapshot froze): ``name`` is its
    mount in the sandbox's directory (read-only, private), ``owner`` the uid owning its files on disk,
    ``view`` the mount its overlay reads (``name`` itself, or an idmapped mount of it showing the files
    as the sandbox's uid's)."""

    name: str
    owner: int
    view: str


@dataclass(frozen=True)
class View:
    """How a sandbox's files are made, kept in ``outer/view.json`` (none: box/ alone): an overlay on box/
    of ``layers`` (top first), its writes in ``upper`` (below outer), ``stacked`` overlays mounted on
    box/'s own mount; ``copied``: a layer is a copy's tree on base_dir's disk, which no snapshot holds
    without a copy."""

    layers: tuple[Layer, ...] = ()
    upper: str | None = None
    stacked: int = 0
    copied: bool = False

    def record(self) -> dict[str, Any]:
        return {
            "layers": [[layer.name, layer.owner, layer.view] for layer in self.layers],
            "upper": self.upper,
            "stacked": self.stacked,
            "copied": self.copied,
        }


def read_view(outer: Path) -> View | None:
    """The sandbox's ``View``: box/ alone when it has none and box/ is its tmpfs's (not an overlay);
    None when it cannot be known (an overlay without a record, or a record that is not one of ours)."""
    try:
        record = read_record(outer, os.geteuid(), VIEW)
    except FileNotFoundError:
        return View() if os.stat(outer / "box").st_dev == os.stat(outer).st_dev else None
    except (OSError, ValueError, RecursionError):
        return None
    layers, upper, stacked, copied = (record.get(key) for key in ("layers", "upper", "stacked", "copied"))
    if not (isinstance(layers, list) and len(layers) <= MAX_LAYERS and type(stacked) is int and type(copied) is bool):
        return None
    if not (upper is None or (isinstance(upper, str) and re.fullmatch(rf"(gen{_NUMBERED}/)?upper", upper))):
        return None
    found = []
    for entry in layers:
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[1]) is int):
            return None
        name, owner, view = entry
        if not (isinstance(name, str) and re.fullmatch(f"layer{_NUMBERED}", name)):
            return None
        if not (isinstance(view, str) and re.fullmatch(f"(layer|lower){_NUMBERED}", view)):
            return None
        found.append(Layer(name, owner, view))
    return View(tuple(found), upper, stacked, copied)


def _replace(directory: Path, name: str, data: bytes) -> None:
    """Write ``directory/name`` (this process's, private) whole, in place of what it held."""
    with contextlib.suppress(FileNotFoundError):  # left by a process killed between its two steps
        os.unlink(directory / (name + ".new"))
    write_private(directory, name + ".new", data)
    os.replace(directory / (name + ".new"), directory / name)


def _write_view(outer: Path, view: View) -> None:
    _replace(outer, VIEW, json.dumps(view.record()).encode())


def _read_sizes(directory: Path) -> Sizes | None:
    """What each directory of the files held when they were last measured (``_SIZES``), if recorded."""
    try:
        record = read_record(directory, os.geteuid(), _SIZES)
    except (OSError, ValueError, RecursionError):
        return None
    sizes: Sizes = {}
    for path, counts in record.items():
        if not (isinstance(counts, list) and len(counts) == 2 and all(type(count) is int for count in counts)):
            return None
        sizes[path] = (counts[0], counts[1])
    return sizes


def rotate(
    base: Path,
    outer: Path,
    freezer: Freezer,
    uid: int | None,
    size: int,
    metadata: Mapping[str, str],
    source: str,
    path: str,
    provider: str = "local",
) -> SandboxSnapshot | None:
    """A snapshot of the whole of a sandbox's files without a copy (blocking), or None when it cannot be
    taken so now and the caller copies: another process's snapshot or an upload under way (``outer``'s
    lock), no freezer, a command running (``freezer.busy``), a layer that is a copy's tree, or
    ``MAX_LAYERS`` layers. The snapshot is ``provider``'s, its record in ``base``.

    Under ``outer``'s lock (exclusive) and ``ROTATING`` (what a process killed meanwhile left is undone
    by the next one, ``_undo``), with the sandbox frozen: what it writes to now (its upper layer, or
    box/ itself) becomes a read-only layer, kept by the snapshot (read-only mounts in its directory,
    with the layers below it) and put under the sandbox's files, which go on in a new tmpfs of ``size``
    bytes of their own, an overlay mounted on box/ (the sandbox's view, a slave of box/, shows it)."""
    with locked(outer, exclusive=True, wait=False) as alone:
        if not alone:
            return None
        if os.path.lexists(outer / ROTATING):
            _undo(outer, freezer)
        view = read_view(outer)
        if view is None or view.copied or len(view.layers) >= MAX_LAYERS:
            return None
        write_private(outer, ROTATING, b"")
        try:
            with freezer.frozen() as frozen:
                if not frozen or freezer.busy():
                    return None
                return _rotate(base, outer, view, uid, size, metadata, source, path, provider)
        finally:  # thawed first
            os.unlink(outer / ROTATING)


def _rotate(
    base: Path,
    outer: Path,
    view: View,
    uid: int | None,
    size: int,
    metadata: Mapping[str, str],
    source: str,
    path: str,
    provider: str,
) -> SandboxSnapshot:
    snapshot_id = f"snap-{uuid.uuid4().hex[:13]}"
    owner = os.geteuid() if uid is None else uid
    written = outer / (view.upper or "box")
    frozen = [(written, owner), *((outer / layer.name, layer.owner) for layer in view.layers)]
    budget = Budget(size)  # what a fork will see: its size_bytes, bounded as a copy's would be
    upper = None if view.upper is None else outer / view.upper
    sizes = measure(outer / "box", budget, upper, None if upper is None else _read_sizes(outer))
    write_maker(base, snapshot_id)  # first: killed from here on, the next sweep removes what is left
    kept: Path | None = None
    mounted: list[Path] = []  # the sandbox's new mounts, the last first: undone on failure
    try:
        kept = Path(tempfile.mkdtemp(prefix=f"{snapshot_id}-", dir=base))
        for number, (tree, _) in enumerate(frozen):
            os.mkdir(kept / f"layer-{number}", 0o700)
            clone_readonly(tree, kept / f"layer-{number}")
        count = len(view.layers)
        new = Layer(f"layer-{count}", owner, f"layer-{count}")
        space = outer / f"gen-{count}"
        os.mkdir(outer / new.name, 0o700)
        clone_readonly(written, outer / new.name)
        mounted.insert(0, outer / new.name)
        os.mkdir(space, 0o700)
        mount_tmpfs(space, size)
        mounted.insert(0, space)
        os.mkdir(space / "upper", 0o700)
        os.mkdir(space / "work", 0o700)
        if uid is not None:
            os.chown(space / "upper", uid, uid)
        stack = (new, *view.layers)
        mount_overlay([outer / layer.view for layer in stack], space / "upper", space / "work", outer / "box")
        mounted.insert(0, outer / "box")
        if not os.path.lexists(outer / PINNED):
            write_private(outer, PINNED, b"")
        counted = json.dumps(sizes).encode()
        _replace(outer, _SIZES, counted)  # for its next snapshot, and its forks':
        write_private(kept, _SIZES, counted)
        _write_view(outer, View(stack, f"{space.name}/upper", view.stacked + 1))
        mounted.clear()  # the sandbox's files are the new ones from here on
        snapshot = SandboxSnapshot(snapshot_id, provider, time.time(), budget.copied, dict(metadata))
        keep(kept, snapshot, source, [path], [(f"layer-{number}", owner) for number, (_, owner) in enumerate(frozen)])
        return snapshot
    except BaseException:
        for target in mounted:  # the overlay on box/ first, then the new tmpfs and layer (their directories too)
            with contextlib.suppress(OSError):
                unmount(target)
                if target != outer / "box":
                    os.rmdir(target)
        abandon(base, snapshot_id, kept)
        raise


def _undo(outer: Path, freezer: Freezer) -> None:
    """What a process killed while rotating the sandbox at ``outer`` left (``ROTATING`` is there, and it
    holds no lock on ``outer`` any more): the mounts it made that its view does not record go, and the
    sandbox is thawed."""
    view = read_view(outer)
    if view is not None:
        for _ in range(mounted_at(outer / "box") - 1 - view.stacked):  # box/'s own mount, then its overlays
            unmount(outer / "box")
        for name in (f"gen-{len(view.layers)}", f"layer-{len(view.layers)}"):
            if is_mount_point(outer / name):
                unmount(outer / name)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(outer / name)
    freezer.thaw()
    os.unlink(outer / ROTATING)


def repair(outer: Path, freezer: Freezer | None) -> None:
    """Undo a rotation of the sandbox at ``outer`` that its process did not finish (killed: it left its
    sandbox frozen), unless one is under way."""
    if freezer is None or not os.path.lexists(outer / ROTATING):
        return
    with locked(outer, exclusive=True, wait=False) as alone:
        if alone and os.path.lexists(outer / ROTATING):
            _undo(outer, freezer)


def uploading(outer: Path) -> contextlib.AbstractContextManager[bool]:
    """Held while an upload writes into the sandbox at ``outer``: no snapshot freezes its files meanwhile."""
    return locked(outer, exclusive=False)


Sizes = dict[str, tuple[int, int]]  # per directory (its path below the root, "" the root): entries and bytes below


def measure(root: Path, budget: Budget, upper: Path | None = None, known: Sizes | None = None) -> Sizes:
    """Count the files under ``root`` (a still tree: the sandbox is frozen) into ``budget``: each entry,
    and the bytes of regular files, following no symlink; past the budget, ``SandboxSnapshotError``.
    Returns what each directory holds. ``root`` an overlay whose writes are in ``upper``: a directory
    that is not in ``upper`` is only its layers', unchanged since ``known`` was measured (the same files'
    last snapshot), so its count is taken from ``known`` instead of walked again."""
    sizes: Sizes = {}
    fd = os.open(root, DIRECTORY)
    try:
        tops = None if upper is None or known is None else os.open(upper, DIRECTORY)
        try:
            sizes[""] = _measure(fd, tops, "", 0, budget, known or {}, sizes)
        finally:
            if tops is not None:
                os.close(tops)
    finally:
        os.close(fd)
    return sizes


def _measure(
    fd: int, upper: int | None, where: str, depth: int, budget: Budget, known: Sizes, sizes: Sizes
) -> tuple[int, int]:
    entries = total = 0
    with os.scandir(fd) as listing:
        found = list(listing)
    for entry in found:
        budget.entry()
        entries += 1
        if entry.is_dir(follow_symlinks=False):
            path = f"{where}/{entry.name}" if where else entry.name
            mine = None
            if upper is not None:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    mine = os.open(entry.name, DIRECTORY, dir_fd=upper)
            try:
                if upper is not None and mine is None and path in known:  # only its layers': as it was
                    below = known[path]
                    budget.entry(below[0])
                    budget.took(below[1])
                else:
                    if depth >= MAX_DEPTH:
                        raise too_deep()
                    child = os.open(entry.name, DIRECTORY, dir_fd=fd)
                    try:
                        below = _measure(child, mine, path, depth + 1, budget, known, sizes)
                    finally:
                        os.close(child)
            finally:
                if mine is not None:
                    os.close(mine)
            sizes[path] = below
            entries += below[0]
            total += below[1]
        elif entry.is_file(follow_symlinks=False):
            size = entry.stat(follow_symlinks=False).st_size
            budget.took(size)
            total += size
    return entries, total


def fill(outer: Path, layers: Sequence[tuple[Path, int]], uid: int | None, can_mount: bool) -> None:
    """Make a fork's files (``outer/box``, empty; a shared mount when this process may mount) the
    snapshot's ``layers``: an overlay on them mounted on box/ (its view shows it), its writes in
    ``outer/upper`` (its own tmpfs), each layer mounted read-only in ``outer`` and, where its files are
    another uid's, seen as the fork's uid's through an idmapped mount; its ``View`` recorded. Where this
    process may not mount (a copied snapshot's one tree then), a copy."""
    if not can_mount:
        with open_directory(layers[0][0], (), "snapshot") as src, open_directory(outer / "box", (), "fork") as dst:
            copy_names(src, dst, os.listdir(src), Budget(None))
        return
    stack = []
    mappings: dict[int, int] = {}  # per owner: a user namespace showing its files as the fork's uid's
    try:
        for number, (tree, owner) in enumerate(layers):
            layer = Layer(f"layer-{number}", owner, f"layer-{number}" if uid in (None, owner) else f"lower-{number}")
            os.mkdir(outer / layer.name, 0o700)
            clone_readonly(tree, outer / layer.name)
            if uid is not None and layer.view != layer.name:
                if owner not in mappings:
                    mappings[owner] = userns_mapping(owner, uid)
                os.mkdir(outer / layer.view, 0o700)
                clone_readonly(outer / layer.name, outer / layer.view, mappings[owner])
            stack.append(layer)
    finally:
        for userns in mappings.values():
            os.close(userns)
    for name in ("upper", "work"):
        os.mkdir(outer / name, 0o700)
    if uid is not None:
        os.chown(outer / "upper", uid, uid)
    mount_overlay([outer / layer.view for layer in stack], outer / "upper", outer / "work", outer / "box")
    copied = any(tree.name == TREE for tree, _ in layers)
    sizes = None if copied else _read_sizes(layers[0][0].parent)  # its snapshot's: its own first snapshot's start
    if sizes is not None:
        write_private(outer, _SIZES, json.dumps(sizes).encode())
    _write_view(outer, View(tuple(stack), "upper", 1, copied))
