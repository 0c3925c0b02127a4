"""LocalProvider's snapshots: a sandbox's files frozen in place as read-only layers (or copied once into
base_dir), forks made copy-on-write on them.

A snapshot is a directory ``base_dir/<snapshot id>-<random>`` (``snap-`` and 13 hex digits: the length
of a sandbox id) holding its files and ``snapshot.json``, its record (the descriptor's fields, the
sandbox it came from, the paths and its layers), written last: a snapshot without a record is
half-made (its maker file names the process making it) or deleted. Its files are one of:

- layers (``rotate``): of the whole sandbox root under bwrap, with the sandbox frozen and no command
  running. What the sandbox writes to (box/ itself, or the upper layer of its overlay) and the layers
  below it become ``layer-0``, ``layer-1``, ... (top first): read-only private mounts of those trees,
  kept alive by the mounts (the sandbox's tmpfs outlives the sandbox). The sandbox goes on in a new
  tmpfs of its ``disk_gib``, an overlay of those layers mounted on box/, which the sandbox's view (a
  slave of box/, ``_mounts.share``) shows at once. No copy, as of one moment; in memory (tmpfs), so
  a reboot loses it: a fork of one whose layers are no mounts any more is refused;
- a copy (``take``, otherwise): ``tree/``, this process's files as the sandbox root held them (the
  working directory, or the paths asked for, at their place below the root), made while the sandbox
  runs, by descriptor, following no symlink (links are kept as links), one file after another: not as
  of one moment.

Either is bounded by the sandbox's ``disk_gib``: more bytes than that, or more entries than its
tmpfs holds (``entry_bound``), is refused (``SandboxSnapshotError``). A fork's files (``fill``) are an
overlay of the snapshot's layers (or tree) mounted on the fork's box/ while it runs, each layer
mounted read-only in the fork's directory (idmapped where its files are another uid's), its writes in
the fork's own tmpfs: a fork costs no copy and what it writes counts against its own ``disk_gib``;
where this process may not mount (not root), the tree is copied into the fork instead. A fork's record
names its snapshot; ``delete_snapshot`` removes the record at once (no listing shows it, no descriptor
is accepted) and the files once no sandbox of base_dir names it (the last fork's close, or the next
sweep): a reference count kept on disk, under a ``flock`` of the snapshot's directory (shared while a
fork is made, exclusive to remove it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._errors import SandboxSnapshotError, SandboxSnapshotNotFoundError, SandboxValueError
from ..._protocol import SandboxSnapshot
from .._common._limits import entry_bound
from ._cgroups import CgroupBackend
from ._mounts import clone_readonly, is_mount_point, mount_overlay, mount_tmpfs, mounted_at, unmount, userns_mapping
from ._records import (
    PINNED,
    ROTATING,
    VIEW,
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
    "SNAPSHOT_ID",
    "SNAPSHOT_RECORD",
    "delete",
    "fill",
    "held",
    "listed",
    "release",
    "repair",
    "retired",
    "rotate",
    "take",
]

SNAPSHOT_ID = re.compile(r"snap-[0-9a-f]{13}")
SNAPSHOT_RECORD = "snapshot.json"
_TREE = "tree"  # a copied snapshot's one layer
_LAYER = re.compile(r"layer-[0-9]{1,3}")  # a rotated snapshot's layers: read-only mounts
MAX_LAYERS = 16  # a sandbox whose files are this many layers deep is copied instead (overlayfs's options fit a page)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 256  # directories held open at once while copying: a deeper tree is refused
_CHUNK = 1 << 24
_FIELDS = ("snapshot_id", "provider", "created", "size_bytes", "metadata")  # a record's descriptor
_NUMBERED = r"-[0-9]{1,3}"
_SIZES = "sizes.json"  # beside box/, and in a snapshot's directory: what each directory held (``measure``)


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
    """What each directory of the files held when they were last measured (``SIZES``), if recorded."""
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


def _too_deep() -> SandboxSnapshotError:
    return SandboxSnapshotError(
        f"the files to snapshot nest more than {_MAX_DEPTH} directories deep; snapshot a shallower tree"
    )


def _over(limit: int) -> SandboxSnapshotError:
    return SandboxSnapshotError(
        f"the files to snapshot hold more than {limit} bytes, the sandbox's disk limit (disk_gib); nothing was kept: "
        "snapshot fewer paths, or make the sandbox with a larger disk_gib"
    )


class Budget:
    """What a copy may still take: bytes of files and entries (files, links, directories); None: no
    bound. A snapshot's is its sandbox's ``disk_gib`` and that tmpfs's inode bound (``entry_bound``),
    so a copy taken while the sandbox runs cannot carry more than its space ever held at once, however
    the sandbox renames and recreates entries under the copier (each entry met counts once)."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.most = None if size is None else entry_bound(size)
        self.entries = 0
        self.copied = 0

    def entry(self, count: int = 1) -> None:
        self.entries += count
        if self.most is not None and self.entries > self.most:
            raise SandboxSnapshotError(
                f"the files to snapshot are more than {self.most} entries, more than the sandbox's disk "
                "(disk_gib) holds at once; nothing was kept: snapshot fewer paths"
            )

    def took(self, size: int) -> None:
        self.copied += size
        if self.size is not None and self.copied > self.size:
            raise _over(self.size)


def _copy_file(source: int, target: int, name: str, budget: Budget) -> None:
    """Copy regular file ``name`` of directory ``source`` into ``target`` (mode and times kept, set-id bits
    dropped), its bytes taken from ``budget``; nothing when it is not a regular file any more (swapped
    meanwhile: not kept)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=source)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES):
            return
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=target)
        try:
            while sent := os.sendfile(out, fd, None, _CHUNK):
                budget.took(sent)
            os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o1777)
            os.utime(out, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def copy_names(source: int, target: int, names: Sequence[str], budget: Budget) -> None:
    """Copy the entries ``names`` of directory ``source`` into directory ``target`` (descriptors, kept
    open), whole trees, following no symlink (a link is copied as a link); directories, regular files and
    symlinks only, each taken from ``budget`` (past it, ``SandboxSnapshotError``)."""
    # Per directory being copied: its descriptor, its copy's, the names left, its name and stat (its parent's).
    stack: list[tuple[int, int, Iterator[str], str, os.stat_result | None]] = []
    stack.append((os.dup(source), os.dup(target), iter(names), "", None))
    try:
        while stack:
            src, dst, pending, _, _ = stack[-1]
            name = next(pending, None)
            if name is None:
                _, _, _, own, info = stack.pop()
                os.close(src)
                os.close(dst)
                if info is not None:  # its mode last: a directory without write permission is still filled
                    os.chmod(own, stat.S_IMODE(info.st_mode) & 0o1777, dir_fd=stack[-1][1], follow_symlinks=False)
                    os.utime(own, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=stack[-1][1], follow_symlinks=False)
                continue
            try:
                info = os.stat(name, dir_fd=src, follow_symlinks=False)
                budget.entry()
                if stat.S_ISLNK(info.st_mode):
                    os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
                    os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
                elif stat.S_ISREG(info.st_mode):
                    _copy_file(src, dst, name, budget)
                elif stat.S_ISDIR(info.st_mode):
                    if len(stack) > _MAX_DEPTH:
                        raise _too_deep()
                    child = os.open(name, _DIR, dir_fd=src)
                    try:
                        os.mkdir(name, 0o700, dir_fd=dst)
                        copy = os.open(name, _DIR, dir_fd=dst)
                    except BaseException:
                        os.close(child)
                        raise
                    stack.append((child, copy, iter(os.listdir(child)), name, info))
            except OSError as exc:  # removed or swapped meanwhile (the sandbox runs): as of now, not there
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    raise
    finally:
        for src, dst, _, _, _ in stack:
            os.close(src)
            os.close(dst)


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
        os.mkdir(outer / _TREE, 0o700)
        budget = Budget(limit)
        for parts, path in chosen:
            with (
                open_directory(root, parts[:-1], path) as src,
                open_directory(outer / _TREE, parts[:-1], path, create=True) as dst,
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
        _keep(outer, snapshot, source, [path for _, path in chosen], [(_TREE, os.geteuid())])
        return snapshot
    except BaseException:
        _abandon(base, snapshot_id, outer)
        raise


def _keep(outer: Path, snapshot: SandboxSnapshot, source: str, paths: list[str], layers: list[tuple[str, int]]) -> None:
    """Write the snapshot's record (last: from here on it exists) and drop its maker file."""
    record = {
        **snapshot.to_dict(),
        "source": source,
        "paths": paths,
        "layers": [{"name": name, "uid": owner} for name, owner in layers],
    }
    write_private(outer, SNAPSHOT_RECORD, json.dumps(record).encode())
    drop_maker(outer)


def _abandon(base: Path, snapshot_id: str, outer: Path | None) -> None:
    """Remove a half-made snapshot; what cannot be removed, the next sweep finds by its maker file."""
    if outer is None:
        drop_maker(base / snapshot_id)
    else:
        remove_box(outer, False, [])  # drops the maker once nothing is left


def rotate(
    base: Path,
    outer: Path,
    cgroups: CgroupBackend,
    groups: Sequence[Path],
    uid: int | None,
    size: int,
    metadata: Mapping[str, str],
    source: str,
    path: str,
) -> SandboxSnapshot | None:
    """A snapshot of the whole of a sandbox's files without a copy (blocking), or None when it cannot be
    taken so now and the caller copies: another process's snapshot or an upload under way (``outer``'s
    lock), no freezer, a command running, a layer that is a copy's tree, or ``MAX_LAYERS`` layers.

    Under ``outer``'s lock (exclusive) and ``ROTATING`` (what a process killed meanwhile left is undone
    by the next one, ``_undo``), with the sandbox frozen: what it writes to now (its upper layer, or
    box/ itself) becomes a read-only layer, kept by the snapshot (read-only mounts in its directory,
    with the layers below it) and put under the sandbox's files, which go on in a new tmpfs of ``size``
    bytes of their own, an overlay mounted on box/ (the sandbox's view, a slave of box/, shows it)."""
    with _locked(outer, exclusive=True, wait=False) as alone:
        if not alone:
            return None
        if os.path.lexists(outer / ROTATING):
            _undo(outer, cgroups, groups)
        view = read_view(outer)
        if view is None or view.copied or len(view.layers) >= MAX_LAYERS:
            return None
        write_private(outer, ROTATING, b"")
        try:
            with cgroups.frozen(groups) as frozen:
                if not frozen or cgroups.commands_running(groups):
                    return None
                return _rotate(base, outer, view, uid, size, metadata, source, path)
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
        _replace(outer, _SIZES, json.dumps(sizes).encode())  # for its next snapshot, and its forks':
        write_private(kept, _SIZES, json.dumps(sizes).encode())
        _write_view(outer, View(stack, f"{space.name}/upper", view.stacked + 1))
        mounted.clear()  # the sandbox's files are the new ones from here on
        snapshot = SandboxSnapshot(snapshot_id, "local", time.time(), budget.copied, dict(metadata))
        _keep(kept, snapshot, source, [path], [(f"layer-{number}", owner) for number, (_, owner) in enumerate(frozen)])
        return snapshot
    except BaseException:
        for target in mounted:  # the overlay on box/ first, then the new tmpfs and layer (their directories too)
            with contextlib.suppress(OSError):
                unmount(target)
                if target != outer / "box":
                    os.rmdir(target)
        _abandon(base, snapshot_id, kept)
        raise


def _undo(outer: Path, cgroups: CgroupBackend, groups: Sequence[Path]) -> None:
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
    cgroups.thaw(groups)
    os.unlink(outer / ROTATING)


def repair(outer: Path, cgroups: CgroupBackend | None, groups: Sequence[Path]) -> None:
    """Undo a rotation of the sandbox at ``outer`` that its process did not finish (killed: it left its
    sandbox frozen), unless one is under way."""
    if cgroups is None or not os.path.lexists(outer / ROTATING):
        return
    with _locked(outer, exclusive=True, wait=False) as alone:
        if alone and os.path.lexists(outer / ROTATING):
            _undo(outer, cgroups, groups)


def uploading(outer: Path) -> contextlib.AbstractContextManager[bool]:
    """Held while an upload writes into the sandbox at ``outer``: no snapshot freezes its files meanwhile."""
    return _locked(outer, exclusive=False)


Sizes = dict[str, tuple[int, int]]  # per directory (its path below the root, "" the root): entries and bytes below


def measure(root: Path, budget: Budget, upper: Path | None = None, known: Sizes | None = None) -> Sizes:
    """Count the files under ``root`` (a still tree: the sandbox is frozen) into ``budget``: each entry,
    and the bytes of regular files, following no symlink; past the budget, ``SandboxSnapshotError``.
    Returns what each directory holds. ``root`` an overlay whose writes are in ``upper``: a directory
    that is not in ``upper`` is only its layers', unchanged since ``known`` was measured (the same files'
    last snapshot), so its count is taken from ``known`` instead of walked again."""
    sizes: Sizes = {}
    fd = os.open(root, _DIR)
    try:
        tops = None if upper is None or known is None else os.open(upper, _DIR)
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
                    mine = os.open(entry.name, _DIR, dir_fd=upper)
            try:
                if upper is not None and mine is None and path in known:  # only its layers': as it was
                    below = known[path]
                    budget.entry(below[0])
                    budget.took(below[1])
                else:
                    if depth >= _MAX_DEPTH:
                        raise _too_deep()
                    child = os.open(entry.name, _DIR, dir_fd=fd)
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


def _not_found(snapshot: SandboxSnapshot, base: Path, why: str) -> SandboxSnapshotNotFoundError:
    return SandboxSnapshotNotFoundError(
        f"LocalProvider: no snapshot {snapshot.snapshot_id!r} in base_dir {base} ({why}); take a new one "
        "(a snapshot is used by a LocalProvider of the base_dir that took it, with its descriptor unchanged)"
    )


def _find(base: Path, snapshot: object, provider: str) -> tuple[Path, dict[str, Any]]:
    """The directory of ``snapshot`` in base_dir and its record, its descriptor checked against it."""
    if not isinstance(snapshot, SandboxSnapshot):
        raise SandboxValueError(f"a snapshot must be a SandboxSnapshot, not {type(snapshot).__name__}")
    if snapshot.provider != provider:
        raise _not_found(snapshot, base, f"it was taken by provider {snapshot.provider!r}")
    if not SNAPSHOT_ID.fullmatch(snapshot.snapshot_id):  # never a path: '../', '/', NUL never reach one
        raise _not_found(snapshot, base, "that is no LocalProvider snapshot id")
    found = directories_of(base, snapshot.snapshot_id)
    try:
        record = read_record(found[0], os.geteuid(), SNAPSHOT_RECORD) if len(found) == 1 else None
    except (OSError, ValueError, RecursionError):
        record = None
    if record is None:
        raise _not_found(snapshot, base, "never taken there, or deleted")
    if {name: record.get(name) for name in snapshot.to_dict()} != snapshot.to_dict():
        raise _not_found(snapshot, base, "the descriptor does not match the snapshot's record")
    return found[0], record


@contextlib.contextmanager
def _locked(outer: Path, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """``outer``'s ``flock`` (a snapshot's directory, or a sandbox's), held in the block; without ``wait``,
    yields False at once when another holds it."""
    fd = os.open(outer, _DIR)
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
    with _locked(outer, exclusive=False):
        _, record = _find(base, snapshot, provider)  # deleted while we waited for the lock?
        yield _layers(outer, record, snapshot, base)


def _layers(outer: Path, record: Mapping[str, Any], snapshot: SandboxSnapshot, base: Path) -> list[tuple[Path, int]]:
    """The layers a snapshot's record names (a copy's one tree when it names none), each there."""
    named = record.get("layers", [{"name": _TREE, "uid": os.geteuid()}])
    layers = []
    for entry in named if isinstance(named, list) and 0 < len(named) <= MAX_LAYERS else [None]:
        name, owner = (entry.get("name"), entry.get("uid")) if isinstance(entry, dict) else (None, None)
        if not (name == _TREE or (isinstance(name, str) and _LAYER.fullmatch(name))) or type(owner) is not int:
            raise _not_found(snapshot, base, "its record names no layers a snapshot has")
        if name != _TREE and os.stat(outer / name).st_dev == os.stat(outer).st_dev:
            raise _not_found(snapshot, base, "its files, kept in memory, are gone (a reboot, or unmounted)")
        layers.append((outer / name, owner))
    return layers


def _referenced(base: Path, snapshot_id: str) -> bool:
    return any(record.get("snapshot") == snapshot_id for _, _, record in scan(base))


def _remove_unreferenced(base: Path, outer: Path, snapshot_id: str) -> list[str]:
    """Remove the tree of a snapshot without a record once no sandbox of base_dir names it (under its lock)."""
    try:
        with _locked(outer, exclusive=True):
            if not os.path.lexists(outer) or (outer / SNAPSHOT_RECORD).exists() or _referenced(base, snapshot_id):
                return []  # removed by another fork's close meanwhile, or still in use
            return remove_box(outer, False, [])
    except FileNotFoundError:  # removed before we could lock it
        return []


def delete(base: Path, snapshot: SandboxSnapshot, provider: str) -> list[str]:
    """Delete ``snapshot``: its record at once, its tree once no fork names it; what could not be removed."""
    outer, _ = _find(base, snapshot, provider)
    with _locked(outer, exclusive=True):
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
    copied = any(tree.name == _TREE for tree, _ in layers)
    sizes = None if copied else _read_sizes(layers[0][0].parent)  # its snapshot's: its own first snapshot's start
    if sizes is not None:
        write_private(outer, _SIZES, json.dumps(sizes).encode())
    _write_view(outer, View(tuple(stack), "upper", 1, copied))
