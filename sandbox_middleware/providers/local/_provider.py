"""``LocalProvider``: real sandboxes on this machine, hardened against the commands they run.

The class alone: what each sandbox is made of lives beside it (see ``providers/README.md``).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

import anyio
import anyio.to_thread

from ..._bounds import Bound, Bounds
from ..._errors import (
    BwrapUnavailableError,
    SandboxArgumentError,
    SandboxCreateError,
    SandboxError,
    SandboxExpiredError,
    SandboxLimitError,
    SandboxNotFoundError,
    SandboxSnapshotError,
)
from ..._owner import Owner
from ..._protocol import (
    SandboxEndpoint,
    SandboxExecResult,
    SandboxHandle,
    SandboxListing,
    SandboxSnapshot,
    SandboxSpec,
    SandboxStatus,
)
from ..._reaper import ReapedSandbox, UnreapedSandbox
from .._common._arguments import (
    DEFAULT_VIEW_ROOT,
    SYSTEM_DIRS,
    check_text,
    checked_env,
    checked_ro_path,
    checked_texts,
    checked_view_root,
    fspath,
    positive_number,
    sandbox_id_of,
    sandbox_parts,
)
from .._common._base import ExecCall, ProviderBase
from .._common._deadlines import checked_ttl, exec_deadline
from .._common._limits import LIMIT_BOUNDS, Limits
from .._common._uids import UidLease, sweep_leases
from ._bwrap import BASE_PATH, HOST_ENV, BwrapCommand
from ._cgroups import CgroupBackend
from ._commands import run_command, run_process
from ._descriptors import DESCRIPTOR_KEYS, sign, verified_body
from ._enforcement import Enforcement
from ._launch import OOM_SCORE_ADJ, STARTER_OOM_SCORE_ADJ, Launch
from ._layers import CgroupFreezer, fill, repair, rotate, uploading
from ._mounts import bind_nosuid, is_mount_point, mount_tmpfs, probe_tmpfs, share
from ._records import (
    RECORD,
    SANDBOX_ID,
    SPARE_RECORD,
    Box,
    check_reachable,
    directories_of,
    drop_maker,
    intact,
    is_real_directory,
    kill_box,
    lay_out,
    makers,
    prepare_base,
    remove_box,
    scan,
    teardown,
    write_maker,
    write_private,
)
from ._snapshots import SNAPSHOT_ID, held, listed, release, retired, take
from ._snapshots import delete as delete_tree
from ._spares import Spares
from ._supervisor import CommandStarter, find_python
from ._transfers import check_directory, download, open_directory, upload
from ._watchdog import Watchdog

__all__ = [
    "LocalProvider",
]

Isolation = Literal["none", "bwrap"]
LimitBackend = Literal["auto", "cgroup", "rlimit"]

Shape = tuple[Limits, PurePosixPath]  # what makes sandboxes interchangeable for a spare (_spares.py)
logger = logging.getLogger("sandbox_middleware")


class LocalProvider(ProviderBase):
    """Sandboxes on this machine, each a fresh directory; see docs/local-provider.md, "Security model".

    Commands run ``bash -c`` with stdin from ``/dev/null`` and a clean environment (``PATH``,
    ``HOME`` at the sandbox root, ``LANG=C.UTF-8``, then ``pass_env`` names copied from the host,
    then ``spec.env``, then the call's ``env``). Memory (all sandboxes together within a budget the
    trainer's cgroup leaves), process count and, when asked, CPU are limited with cgroups where the
    machine allows it (rlimits otherwise; see ``mechanisms``), open files with ``RLIMIT_NOFILE``
    (``nofile``); sandbox processes are the kernel's first OOM victims; the writable space
    is a tmpfs of ``disk_gib`` where this process may mount one; ``ttl_s`` kills the sandbox's
    processes when it runs out. Output keeps at most ``max_output_bytes`` per stream (head and tail);
    downloads refuse files over ``max_transfer_bytes``. Transfers follow no symlink.

    ``isolation="bwrap"`` (the default; the one for untrusted code) runs each sandbox under bubblewrap, its
    commands started by one command starter per sandbox (``_starter.py``), each with no capabilities,
    its own PID, mount, network, IPC and UTS namespaces in the sandbox's user and cgroup namespaces,
    and a minimal read-only view of the host; the sandbox directory is seen at ``spec.workdir`` when that is
    absolute, else at ``/workspace``. ``isolation="none"`` runs commands as this process's user
    with the host's whole filesystem in view: limits and the clean environment still hold, but it
    is no security boundary.

    Snapshots (``SupportsSandboxSnapshot``) of a whole bwrap sandbox freeze its files in place as
    read-only layers (no copy); others are copies in ``base_dir``. A sandbox created from one (a fork,
    a spare when one is ready: ``spares``) has an overlay of it mounted on its files, its writes in its
    own tmpfs (``_layers.py``, ``_snapshots.py``; docs/local-provider.md, "Snapshots and forks").
    """

    name = "local"

    BOUNDS: ClassVar[Bounds] = Bounds(
        "LocalProvider",
        **LIMIT_BOUNDS,
        max_output_bytes=Bound(0, strict=True, whole=True, high=2**53),
        max_transfer_bytes=Bound(0, strict=True, whole=True, high=2**53),
        sandbox_uid=Bound(0, strict=True, whole=True, high=2**32 - 2, optional=True),  # never root, never -1
        nofile=Bound(16, whole=True, high=2**20),  # bwrap and bash need a few descriptors
        spares=Bound(1, whole=True, high=64),
    )

    def __init__(
        self,
        *,
        isolation: Isolation = "bwrap",
        base_dir: str | Path | None = None,
        pass_env: Sequence[str] = (),
        memory_mib: float | None = 4096,
        pids: int | None = 1024,
        cpu: float | None = None,
        disk_gib: float | None = 4,
        max_output_bytes: int = 1 << 20,
        max_transfer_bytes: int = 256 << 20,
        ro_paths: Sequence[str] = (),
        limit_backend: LimitBackend = "auto",
        connect_key: bytes | None = None,
        sandbox_uid: int | None = None,
        nofile: int = 256,
        prestart: bool = True,
        spares: int = 1,
    ) -> None:
        # What pickling sends (a Ray actor builds its own provider from it): options, not sandboxes.
        self._options: dict[str, Any] = {
            "isolation": isolation,
            "base_dir": base_dir,
            "pass_env": tuple(pass_env),
            "memory_mib": memory_mib,
            "pids": pids,
            "cpu": cpu,
            "disk_gib": disk_gib,
            "max_output_bytes": max_output_bytes,
            "max_transfer_bytes": max_transfer_bytes,
            "ro_paths": tuple(ro_paths),
            "limit_backend": limit_backend,
            "connect_key": connect_key,
            "sandbox_uid": sandbox_uid,
            "nofile": nofile,
            "prestart": prestart,
            "spares": spares,
        }
        if isolation not in ("none", "bwrap"):
            raise SandboxArgumentError(f"LocalProvider: isolation must be 'none' or 'bwrap', not {isolation!r}")
        if limit_backend not in ("auto", "cgroup", "rlimit"):
            raise SandboxArgumentError(
                f"LocalProvider: limit_backend must be 'auto', 'cgroup' or 'rlimit', not {limit_backend!r}"
            )
        self.BOUNDS.check(locals())
        self.isolation: Isolation = isolation
        if base_dir is None:  # a private directory of ours, not the shared temp directory itself
            # Not resolved: a symlink planted under that name by another user is refused (prepare_base).
            self._base = Path(tempfile.gettempdir()).resolve() / f"llm-sandbox-middleware-{os.geteuid()}"
        else:
            self._base = Path(check_text(fspath(base_dir, "base_dir"), "base_dir")).resolve()
        for name in pass_env:
            check_text(name, "pass_env entry")
        self._pass_env = tuple(pass_env)
        self._defaults: dict[str, float | None] = {
            "memory_mib": memory_mib,
            "pids": pids,
            "cpu": cpu,
            "disk_gib": disk_gib,
        }
        self._max_output = max_output_bytes
        self._max_transfer = max_transfer_bytes
        self._ro_paths = tuple(checked_ro_path(path) for path in ro_paths)
        self._bwrap: BwrapCommand | None = None
        if isolation == "bwrap":
            if any(self._base == Path(d) or Path(d) in self._base.parents for d in (*SYSTEM_DIRS, *self._ro_paths)):
                raise SandboxArgumentError(
                    f"LocalProvider: base_dir {self._base} lies in a directory every sandbox sees read-only; "
                    "sandboxes could read each other's files: choose a base_dir elsewhere"
                )
            self._bwrap = BwrapCommand(ro_paths=self._ro_paths)
            if self._bwrap.drops_privileges:
                for path in map(Path, self._ro_paths):
                    check_reachable(path)
                check_reachable(self._base)
        prepare_base(self._base)
        self._cgroups = CgroupBackend(nofile=nofile) if limit_backend != "rlimit" else None
        if limit_backend == "cgroup" and (self._cgroups is None or not self._cgroups.resources):
            raise SandboxLimitError("LocalProvider(limit_backend='cgroup'): no writable cgroup controllers here")
        self._tmpfs = probe_tmpfs()
        self._enforcement = Enforcement(
            self._cgroups, self._tmpfs, self._bwrap, sandbox_uid, nofile, self._defaults, max_output_bytes
        )
        self._python: str | None = None
        self._starting = threading.Lock()  # one starter per sandbox adopted from another process
        self._sweep()
        self._spares: Spares[Shape] | None = None
        if self._bwrap is not None and prestart:  # removed with this provider, if not at aclose (or at exit)
            self._spares = Spares(weakref.WeakMethod(self._make_spare), partial(discard, self._base), count=spares)
            weakref.finalize(self, self._spares.close)
        if self._bwrap is not None:
            self._python = find_python([*SYSTEM_DIRS, *self._ro_paths])
            if self._python is None:
                raise BwrapUnavailableError(
                    "LocalProvider(isolation='bwrap') starts each sandbox's commands with a Python 3.9+ that the "
                    f"sandbox can see (under {', '.join(SYSTEM_DIRS)} or ro_paths); none found: install python3 "
                    "(apt-get install -y python3) or add the directory of one to ro_paths"
                )
            self._probe()
        self._key = connect_key if connect_key is not None else os.urandom(32)
        self._boxes: dict[str, Box] = {}
        self._watchdog = Watchdog(self._expire)

    def __repr__(self) -> str:
        return f"LocalProvider(isolation={self.isolation!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its options: the copy is a new provider of the same configuration, holding no
        sandbox; with the same ``connect_key`` (only if one was given) it can ``connect`` to ours."""
        return (_restore, (self._options,))

    def _probe(self) -> None:
        """Start a command starter under bwrap now (it makes its first command's namespaces before it
        answers), so a machine where commands cannot start fails here: in the first spare, when spares
        are on and a sandbox of the default limits can be made, else in a scratch sandbox without limits."""
        view_root = PurePosixPath(DEFAULT_VIEW_ROOT)
        if self._spares is not None:
            with contextlib.suppress(SandboxError):  # a create of the defaults fails the same way, and says why
                limits = Limits.resolve(self._defaults, None)
                self._enforcement.refuse_unenforceable(limits)
                self._spares.offer((limits, view_root), self._make_spare((limits, view_root)))
                return
        try:
            discard(self._base, self._prepare((Limits(None, None, None, None), view_root)))
        except SandboxError as exc:
            raise BwrapUnavailableError(
                f"LocalProvider(isolation='bwrap'): commands cannot start under bwrap on this machine ({exc}); "
                "unprivileged user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone, or an "
                "AppArmor restriction)"
            ) from exc

    def _start_starter(self, outer: Path, view_root: PurePosixPath, launch: Launch, where: str) -> CommandStarter:
        """Launch a sandbox's command starter as its commands used to be launched (blocking)."""
        bwrap, python = self._bwrap, self._python
        assert bwrap is not None and python is not None

        def build(command: list[str], fds: list[int]) -> list[str]:
            return launch.argv(bwrap.argv(outer, view_root, command, launch, fds), oom_score_adj=STARTER_OOM_SCORE_ADJ)

        return CommandStarter.launch(build, python, HOST_ENV, where, oom_score_adj=OOM_SCORE_ADJ)

    def _starter_of(self, box: Box, sandbox_id: str) -> CommandStarter:
        """The box's starter; a sandbox another process made (``connect``) gets one of ours here."""
        with self._starting:
            if box.starter is None:
                try:
                    box.starter = self._start_starter(box.outer, box.view_root, box.launch, f"sandbox {sandbox_id!r}")
                except SandboxError as exc:
                    if not intact(box):
                        raise SandboxNotFoundError(
                            f"LocalProvider: sandbox {sandbox_id!r} was removed from under this provider (closed or "
                            "reaped by another process); create a new one"
                        ) from exc
                    raise
            return box.starter

    @property
    def mechanisms(self) -> dict[str, str]:
        """How each limit is enforced on this machine: only what is enforced, and where a limit is off
        by default (None), that it is."""
        return self._enforcement.mechanisms

    # --- lifecycle -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, from_snapshot: SandboxSnapshot | None = None) -> SandboxHandle:
        """A new sandbox of ``spec``; ``from_snapshot``: its files start as that snapshot's (a fork: see
        ``_layers.py``): a spare when one has its shape, the snapshot's files mounted on it."""
        if spec.entrypoint:
            raise SandboxArgumentError("LocalProvider does not run spec.entrypoint; start the process with exec()")
        env = checked_env(spec.env, "spec.env")
        metadata = checked_texts(spec.metadata, "spec.metadata")
        if getattr(spec.resources, "gpu", None):
            raise SandboxLimitError("LocalProvider has no GPUs to give: drop spec.resources.gpu")
        ttl = checked_ttl(spec.ttl_s)
        limits = Limits.resolve(self._defaults, spec.resources)
        self._enforcement.refuse_unenforceable(limits)
        workdir = check_text(spec.workdir, "spec.workdir") if spec.workdir is not None else None
        cwd: tuple[str, ...] = ()
        if workdir is not None and PurePosixPath(workdir).is_absolute():
            view_root = checked_view_root(workdir)
        else:
            view_root = PurePosixPath(DEFAULT_VIEW_ROOT)
            cwd = sandbox_parts(workdir, (), "spec.workdir") if workdir else ()
        shape = (dataclasses.replace(limits, explicit=frozenset()), view_root)
        make = partial(self._make_box, shape, env, cwd, spec.ports, ttl, metadata)
        if from_snapshot is None:
            box = await anyio.to_thread.run_sync(make)
        else:
            box = await anyio.to_thread.run_sync(self._make_fork, make, from_snapshot, limits)
        sandbox_id = box.sandbox_id
        self._boxes[sandbox_id] = box
        if box.deadline is not None:
            self._watchdog.add(box.deadline, sandbox_id)
        return SandboxHandle(sandbox_id, self.name, {"root": str(box.root)})

    def _make_box(
        self,
        shape: Shape,
        env: dict[str, str],
        cwd: tuple[str, ...],
        ports: Iterable[int],
        ttl: float | None,
        metadata: dict[str, str],
        fork: tuple[str, list[tuple[Path, int]]] | None = None,
    ) -> Box:
        """A sandbox of ``shape`` for a create: a spare when one has that shape, else a new one; then the
        next spare of that shape is made in the background. A ``fork`` (its snapshot's id and layers)
        gets the snapshot's files mounted on its (empty) files once it runs."""
        box = self._spares.take(shape) if self._spares is not None else None
        if box is None:
            box = self._prepare(shape)
        try:
            if fork is not None:  # on the running sandbox: its view of box/ shows what is mounted there
                box.snapshot = fork[0]
                fill(box.outer, fork[1], box.uid, self._tmpfs)
            box.env, box.cwd, box.ports, box.metadata = env, cwd, tuple(ports), metadata
            box.created = time.time()
            box.deadline = None if ttl is None else time.monotonic() + ttl
            write_private(box.outer, RECORD, json.dumps(box.record()).encode())
            with contextlib.suppress(FileNotFoundError):  # a spare's, which list() never shows
                os.unlink(box.outer / SPARE_RECORD)
            drop_maker(box.outer)  # its record names its owner now (a spare's maker went with its SPARE_RECORD)
            with open_directory(box.root, cwd, "spec.workdir", create=True, owner=box.uid):
                pass
        except BaseException as exc:  # a fork's snapshot cannot have been deleted meanwhile: _make_fork holds it
            leftovers = teardown(box, self._base)
            if isinstance(exc, OSError):
                suffix = f"; could not remove {leftovers}" if leftovers else ""
                raise SandboxCreateError(f"LocalProvider: cannot create a sandbox: {exc}{suffix}") from exc
            raise
        if self._spares is not None:
            self._spares.refill(shape)
        return box

    def _make_fork(self, make: Callable[..., Box], snapshot: SandboxSnapshot, limits: Limits) -> Box:
        """``make`` a sandbox whose files start as ``snapshot``'s (blocking), the snapshot kept from
        deletion until the fork has its record, which names it."""
        with held(self._base, snapshot, self.name) as layers:
            if limits.disk_bytes is not None and snapshot.size_bytes > limits.disk_bytes:
                raise SandboxSnapshotError(
                    f"LocalProvider: snapshot {snapshot.snapshot_id!r} holds {snapshot.size_bytes} bytes, more than "
                    f"this sandbox's disk limit of {limits.disk_bytes} bytes (disk_gib); give it a larger disk_gib"
                )
            return make((snapshot.snapshot_id, layers))

    def _prepare(self, shape: Shape) -> Box:
        """A new sandbox of ``shape``: its directory, cgroups, mount (box/ a shared mount of its own, for
        a fork's files to be mounted on), uid and starter (blocking)."""
        limits, view_root = shape
        sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        cgroups: list[Path] = []
        outer: Path | None = None
        mounted = False
        lease: UidLease | None = None
        try:
            write_maker(self._base, sandbox_id)  # first: killed from here on, this process's leftovers are found
            uid, lease = self._enforcement.new_uid()
            outer = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._base))
            if self._cgroups is not None:
                cgroups = self._cgroups.create(sandbox_id, limits)
            if self._tmpfs and limits.disk_bytes is not None:
                mount_tmpfs(outer, limits.disk_bytes)
                mounted = True
            elif self._tmpfs:  # unbounded, still on a mount of its own: nosuid, nodev
                bind_nosuid(outer)
                mounted = True
            lay_out(outer, uid)
            if mounted:
                share(outer / "box")
            box = Box(
                outer=outer,
                view_root=view_root,
                isolated=self._bwrap is not None,
                env={},
                cwd=(),
                ports=(),
                cgroups=cgroups,
                mounted=mounted,
                deadline=None,
                limits=limits,
                metadata={},
                created=time.time(),
                launch=self._enforcement.launch(limits, cgroups, uid),
                lease=lease,
            )
            if self._bwrap is not None:
                try:
                    box.starter = self._start_starter(outer, view_root, box.launch, f"sandbox {sandbox_id!r}")
                except SandboxError as exc:
                    raise SandboxCreateError(f"LocalProvider: cannot create a sandbox: {exc}") from exc
            return box
        except BaseException as exc:
            leftovers = remove_box(outer, mounted, cgroups) if outer is not None else []
            if outer is None:
                drop_maker(self._base / sandbox_id)
            if lease is not None:
                lease.release()
            suffix = f"; could not remove {leftovers}" if leftovers else ""
            if isinstance(exc, SandboxError):
                raise
            if isinstance(exc, OSError):
                raise SandboxCreateError(f"LocalProvider: cannot create a sandbox: {exc}{suffix}") from exc
            raise

    def _make_spare(self, shape: Shape) -> Box:
        """A spare of ``shape`` (in the maker thread): a new sandbox, its record naming this process."""
        box = self._prepare(shape)
        try:
            write_private(box.outer, SPARE_RECORD, json.dumps(Owner.current().metadata()).encode())
            drop_maker(box.outer)
        except BaseException:
            discard(self._base, box)
            raise
        return box

    async def sweep_leftovers(self, *, dry_run: bool = False) -> tuple[list[ReapedSandbox], list[UnreapedSandbox]]:
        """Remove what processes that died left in base_dir: their spares, and the sandboxes they were
        making or removing when they died (a directory, cgroups, a mount, but no record: their maker
        file names them). A live maker's work, or one whose liveness is unknown here (another PID
        namespace, say), is left alone. ``reap`` calls this; a new provider does it at construction.
        Returns what was removed (``dry_run``: what would be), and what was left as of unknown liveness."""
        return await anyio.to_thread.run_sync(self._sweep, dry_run)

    def _sweep(self, dry_run: bool = False) -> tuple[list[ReapedSandbox], list[UnreapedSandbox]]:
        removed, unknown = [], []
        for sandbox_id, outer, record in scan(self._base, SPARE_RECORD):
            owner = Owner.from_metadata(record)
            if owner is None or owner.alive() is not False or (outer / RECORD).exists():
                continue
            why = f"a spare of {owner}, which died without removing it"
            removed.append(self._remove_leftover(sandbox_id, outer, str(owner), why, dry_run))
        for sandbox_id, record in [*makers(self._base), *makers(self._base, SNAPSHOT_ID)]:
            owner = Owner.from_metadata(record)
            alive, why = owner.liveness() if owner is not None else (None, "its maker file names no process")
            if alive:
                continue
            if alive is None:
                unknown.append(UnreapedSandbox(sandbox_id, "", str(owner or "unknown"), f"half-made; {why}"))
                continue
            # Its maker died before the create returned, or while it removed it: nobody holds it, record or not.
            why = f"half-made: {owner} died while making or removing it"
            outers = directories_of(self._base, sandbox_id) or [self._base / sandbox_id]  # none: a maker file, cgroups
            removed += [self._remove_leftover(sandbox_id, outer, str(owner), why, dry_run) for outer in outers]
        if not dry_run:
            sweep_leases()  # the uid leases of makers killed (their files stay, unlocked)
            for snapshot_id in retired(self._base):  # deleted snapshots whose last fork died without releasing them
                release(self._base, snapshot_id)
            for sandbox_id, outer, _ in scan(self._base):  # sandboxes left frozen by a snapshot's killed maker
                repair(outer, self._freezer(sandbox_id))
        return removed, unknown

    def _freezer(self, sandbox_id: str) -> CgroupFreezer | None:
        """What freezes sandbox ``sandbox_id`` (None: no cgroups here)."""
        return None if self._cgroups is None else CgroupFreezer(self._cgroups, self._cgroups.groups_of(sandbox_id))

    def _remove_leftover(self, sandbox_id: str, outer: Path, owner: str, why: str, dry_run: bool) -> ReapedSandbox:
        """Remove a dead process's leftover sandbox (its directory, mount and cgroups); report it."""
        entry = ReapedSandbox(sandbox_id, "", owner, why, closed=False)
        if dry_run:
            return entry
        cgroups = self._cgroups.groups_of(sandbox_id) if self._cgroups is not None else []
        leftovers = remove_box(outer, is_mount_point(outer), cgroups)
        if leftovers:
            logger.warning("LocalProvider: %s (%s) left %s behind", sandbox_id, why, ", ".join(leftovers))
            return dataclasses.replace(entry, error=f"could not remove {', '.join(leftovers)}")
        return dataclasses.replace(entry, closed=True)

    def _box(self, handle: SandboxHandle) -> Box:
        box = self._boxes.get(sandbox_id_of(handle))
        if box is None or box.closed:
            raise SandboxNotFoundError(
                f"LocalProvider: no live sandbox {handle.sandbox_id!r} (never created here, or closed)"
            )
        if box.is_expired():  # the watchdog thread kills its processes
            raise SandboxExpiredError(
                f"LocalProvider: sandbox {handle.sandbox_id!r} expired (its ttl_s ran out) and its processes "
                "were killed; create a new one (close() still removes it)"
            )
        return box

    def _expire(self, sandbox_id: str) -> None:
        box = self._boxes.get(sandbox_id)
        if box is not None and not box.expired:
            box.expired = True
            kill_box(box)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        box = self._boxes.get(sandbox_id_of(handle))
        if box is None:
            return SandboxStatus.STOPPED if handle.provider_name == self.name else SandboxStatus.UNKNOWN
        if box.broken:
            return SandboxStatus.ERROR
        if box.is_expired():
            return SandboxStatus.STOPPED
        if box.starter is not None and not box.starter.alive:  # it died: the sandbox runs no more commands
            return SandboxStatus.ERROR
        return SandboxStatus.RUNNING if await anyio.to_thread.run_sync(intact, box) else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        """Kill, unmount and remove the sandbox. A handle from ``list()`` of a sandbox another process
        made is taken over here first; closing an unknown or closed sandbox does nothing."""
        sandbox_id = sandbox_id_of(handle)
        box = self._boxes.get(sandbox_id)
        if box is None and handle.provider_name == self.name and SANDBOX_ID.fullmatch(sandbox_id):
            box = await anyio.to_thread.run_sync(self._find, sandbox_id)
        if box is None:
            return
        box.closed = True
        leftovers = await anyio.to_thread.run_sync(self._teardown, box)
        if leftovers:
            box.broken = True
            raise SandboxError(
                f"LocalProvider: sandbox {handle.sandbox_id!r} closed, but these could not be removed: "
                f"{', '.join(leftovers[:10])}{' ...' if len(leftovers) > 10 else ''}; remove them by hand"
            )
        del self._boxes[handle.sandbox_id]

    def _teardown(self, box: Box) -> list[str]:
        """Remove the sandbox; a fork's deleted snapshot goes with its last fork."""
        leftovers = teardown(box, self._base)
        if box.snapshot is not None and not leftovers:
            leftovers = release(self._base, box.snapshot)
        return leftovers

    async def aclose(self) -> None:
        """Remove the spare, close every sandbox still open here, then raise one error naming those that failed."""
        if self._spares is not None:
            await anyio.to_thread.run_sync(self._spares.close)
        failures = []
        for sandbox_id in list(self._boxes):
            try:
                await self.close(SandboxHandle(sandbox_id, self.name))
            except SandboxError as exc:
                failures.append(str(exc))
        if failures:
            raise SandboxError(
                f"LocalProvider.aclose: {len(failures)} sandboxes not fully removed: {'; '.join(failures)}"
            )

    # --- commands ----------------------------------------------------------------------------------

    async def _exec(self, handle: SandboxHandle, call: ExecCall) -> SandboxExecResult:
        box = self._box(handle)
        if call.user is not None:
            raise SandboxError("LocalProvider runs commands as the current user; user= is not supported")
        parts = box.cwd
        if call.cwd is not None:  # the default was made at create; under bwrap a swapped one resolves inside anyway
            parts = sandbox_parts(call.cwd, box.roots, "cwd")
            try:
                await anyio.to_thread.run_sync(check_directory, box.root, parts, call.cwd)
            except SandboxError as exc:
                raise SandboxError(
                    f"LocalProvider: cwd {call.cwd!r} is not a directory in sandbox {handle.sandbox_id!r}; "
                    f"create it first ({exc})"
                ) from exc
        child_env = {**self._base_env(box), **box.env, **call.env}
        remaining = None if box.deadline is None else max(0.0, box.deadline - time.monotonic())
        deadline = exec_deadline(call.timeout_s, remaining)
        try:
            if self._bwrap is not None:  # a message to the sandbox's starter, which starts it inside
                starter = box.starter
                if starter is None:
                    starter = await anyio.to_thread.run_sync(self._starter_of, box, handle.sandbox_id)
                inside = str(box.view_root.joinpath(*parts))
                start = partial(starter.run, ["bash", "-c", call.command], child_env, inside)
            else:
                argv = box.launch.argv(["bash", "-c", call.command])
                start = partial(run_process, box, handle, argv, box.root.joinpath(*parts), child_env)
            return await run_command(handle, box, start, deadline, self._max_output)
        except OSError as exc:  # out of descriptors or memory for pipes and memfds, say
            raise SandboxError(f"LocalProvider: cannot run a command in {handle.sandbox_id!r}: {exc}") from exc

    def _base_env(self, box: Box) -> dict[str, str]:
        home = str(box.home)
        env = {"PATH": BASE_PATH, "HOME": home, "LANG": "C.UTF-8"}
        if self._bwrap is None:
            env["TMPDIR"] = str(box.outer / "tmp")
        env.update({name: os.environ[name] for name in self._pass_env if name in os.environ})
        return env

    # --- files -----------------------------------------------------------------------------------

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        box = self._box(handle)
        what = f"upload {source_path} to {target_path!r} in sandbox {handle.sandbox_id!r}"
        inside, outside = ("target_path", target_path), ("source_path", source_path)
        await _transfer(handle, box, what, partial(_upload, box.outer), inside, outside, box.uid)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        box = self._box(handle)
        what = f"download {source_path!r} from sandbox {handle.sandbox_id!r} to {target_path}"
        inside, outside = ("source_path", source_path), ("target_path", target_path)
        await _transfer(handle, box, what, download, inside, outside, self._max_transfer)

    # --- capabilities ------------------------------------------------------------------------------

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint:
        box = self._box(handle)
        if self._bwrap is not None:
            raise SandboxError("LocalProvider(isolation='bwrap') has no network; it serves no endpoints")
        if port not in box.ports:
            raise SandboxError(
                f"port {port} was not declared in the spec of sandbox {handle.sandbox_id!r} "
                f"(declared: {list(box.ports)})"
            )
        return SandboxEndpoint(f"http://127.0.0.1:{port}")

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        box = self._box(handle)
        body = {"provider": self.name, "sandbox_id": handle.sandbox_id, "root": str(box.root), **box.record()}
        assert set(body) == set(DESCRIPTOR_KEYS)
        return {**body, "mac": sign(self._key, body)}

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        """Rebuild a handle from ``serialize_handle()`` of this provider or one sharing its ``connect_key``.

        The descriptor is authenticated (HMAC-SHA256 with the provider's key) and must name a sandbox
        directory inside ``base_dir``; anything else is refused and nothing is touched.
        """
        body = verified_body(self._key, descriptor)
        sandbox_id, root = str(body["sandbox_id"]), Path(body["root"])
        outer = root.parent
        if not SANDBOX_ID.fullmatch(sandbox_id) or not outer.name.startswith(f"{sandbox_id}-"):
            raise SandboxError(f"LocalProvider.connect: {sandbox_id!r} at {root} is not a LocalProvider sandbox")
        if outer.parent != self._base:
            raise SandboxError(
                f"LocalProvider.connect: sandbox {sandbox_id!r} lies in {outer.parent}, not in this provider's "
                f"base_dir {self._base}; connect with a provider of the same base_dir"
            )
        if not await anyio.to_thread.run_sync(is_real_directory, root):
            raise SandboxNotFoundError(f"LocalProvider.connect: sandbox {sandbox_id!r} no longer exists at {root}")
        await anyio.to_thread.run_sync(self._adopt, sandbox_id, outer, body)
        return SandboxHandle(sandbox_id, self.name, {"root": str(root)})

    def _adopt(self, sandbox_id: str, outer: Path, record: Mapping[str, Any]) -> Box:
        """Register a sandbox made by another provider instance (or process) from its record.

        Only ``connect`` (a signed descriptor) and ``close`` (of a listed handle) adopt; every field is
        checked again, and its cgroups and mount are derived, never read from the record.
        """
        box = self._boxes.get(sandbox_id)
        if box is not None:
            return box
        expires_at, created, uid = record.get("expires_at"), record.get("created"), record.get("uid")
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or not 0 < uid < 2**32 - 1):
            raise SandboxArgumentError(f"recorded uid {uid!r} is not an unprivileged uid")
        metadata = record.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise SandboxArgumentError("recorded metadata is not a mapping")
        limits = Limits.from_record(record.get("limits") or [None, None, None, None])
        snapshot = record.get("snapshot")
        if snapshot is not None and not (isinstance(snapshot, str) and SNAPSHOT_ID.fullmatch(snapshot)):
            raise SandboxArgumentError(f"recorded snapshot {snapshot!r} is not a snapshot id")
        cgroups = self._cgroups.groups_of(sandbox_id) if self._cgroups is not None else []
        repair(outer, self._freezer(sandbox_id))  # left frozen by a snapshot's killed maker: its commands would hang
        box = Box(
            outer=outer,
            view_root=checked_view_root(check_text(record.get("view_root", DEFAULT_VIEW_ROOT), "recorded view_root")),
            isolated=self._bwrap is not None,
            env=checked_env(record.get("env") or {}, "recorded env"),
            cwd=sandbox_parts("/".join(record.get("cwd") or ()), (), "cwd") if record.get("cwd") else (),
            ports=tuple(int(port) for port in record.get("ports") or ()),
            cgroups=cgroups,
            mounted=is_mount_point(outer),
            deadline=None
            if expires_at is None
            else time.monotonic() + (positive_number(expires_at, "recorded expires_at") or 0.0) - time.time(),
            limits=limits,
            metadata={
                check_text(k, "recorded metadata"): check_text(v, "recorded metadata") for k, v in metadata.items()
            },
            created=positive_number(created, "recorded created") or 0.0,
            # Its uid stays leased by the process that made it (the lease is that process's).
            launch=self._enforcement.launch(
                limits, cgroups, uid if self._bwrap is not None and self._bwrap.drops_privileges else None
            ),
            snapshot=snapshot,
        )
        self._boxes[sandbox_id] = box
        if box.deadline is not None:
            self._watchdog.add(box.deadline, sandbox_id)
        return box

    async def list(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxListing]:
        """Every sandbox in ``base_dir`` (made by any process) whose metadata has all of ``metadata``.

        Listing changes nothing: a listed handle can be given to ``close`` (which takes the sandbox
        over only then); to run commands in another process's sandbox, ``connect`` its descriptor.
        """
        wanted = dict(metadata or {})
        found = await anyio.to_thread.run_sync(scan, self._base)
        listings = []
        for sandbox_id, outer, record in found:
            recorded = record.get("metadata")
            if not isinstance(recorded, Mapping):
                continue
            box_metadata = {str(key): str(value) for key, value in recorded.items()}
            if any(box_metadata.get(key) != value for key, value in wanted.items()):
                continue
            created = record.get("created")
            handle = SandboxHandle(sandbox_id, self.name, {"root": str(outer / "box")})
            listings.append(SandboxListing(handle, box_metadata, created if isinstance(created, float) else None))
        return listings

    def _find(self, sandbox_id: str) -> Box | None:
        """The sandbox ``sandbox_id`` of base_dir, adopted for ``close``; None if there is none."""
        for found_id, outer, record in scan(self._base):
            if found_id == sandbox_id:
                try:
                    return self._adopt(found_id, outer, record)
                except (SandboxError, ValueError, TypeError):
                    return None
        return None

    # --- snapshots (SupportsSandboxSnapshot; see _layers.py, _snapshots.py, docs/local-provider.md) ---

    async def _snapshot(
        self, handle: SandboxHandle, paths: builtins.list[str] | None, metadata: dict[str, str]
    ) -> SandboxSnapshot:
        """Copy the sandbox's working directory, or ``paths`` (relative to it, or absolute under the
        sandbox root), into a snapshot in base_dir, while it runs (file by file: not as of one moment)."""
        box = self._box(handle)
        if paths is None:
            selections = [(box.cwd, "the working directory")]
        else:
            selections = [
                (
                    sandbox_parts(path, box.roots, "snapshot path")
                    if PurePosixPath(path).is_absolute()
                    else (*box.cwd, *sandbox_parts(path, (), "snapshot path")),
                    path,
                )
                for path in paths
            ]
        take_it = partial(self._take, box, selections, metadata, handle.sandbox_id)
        try:
            return await anyio.to_thread.run_sync(take_it)
        except SandboxError as exc:
            if type(exc) is SandboxError:  # a path that is no directory on the way, say
                raise SandboxSnapshotError(f"LocalProvider: sandbox {handle.sandbox_id!r}: {exc}") from exc
            raise
        except OSError as exc:
            raise SandboxSnapshotError(f"LocalProvider: cannot snapshot {handle.sandbox_id!r}: {exc}") from exc

    def _take(
        self, box: Box, selections: builtins.list[tuple[tuple[str, ...], str]], metadata: dict[str, str], source: str
    ) -> SandboxSnapshot:
        """A snapshot of ``selections`` of the box's files (blocking): of the whole of them, where it can,
        without a copy (``_layers.rotate``: under bwrap, on its tmpfs, its processes frozen and no
        command running, as of that moment); else a copy, made while it runs."""
        size, cgroups, whole = box.limits.disk_bytes, self._cgroups, [parts for parts, _ in selections] == [()]
        if (
            whole
            and self._bwrap is not None
            and cgroups is not None
            and box.cgroups
            and box.mounted
            and size is not None
        ):
            path = selections[0][1]
            freezer = CgroupFreezer(cgroups, box.cgroups)
            rotated = rotate(self._base, box.outer, freezer, box.uid, size, metadata, source, path)
            if rotated is not None:
                return rotated
        return take(self._base, box.root, selections, box.limits.disk_bytes, metadata, source)

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        """Delete ``snapshot`` (checked against its record): at once for every process; its files go once
        the last sandbox made from it is closed, so forks alive keep theirs."""
        leftovers = await anyio.to_thread.run_sync(delete_tree, self._base, snapshot, self.name)
        if leftovers:
            raise SandboxError(
                f"LocalProvider: snapshot {snapshot.snapshot_id!r} deleted, but these could not be removed: "
                f"{', '.join(leftovers[:10])}{' ...' if len(leftovers) > 10 else ''}; remove them by hand"
            )

    async def list_snapshots(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxSnapshot]:
        """Every snapshot in ``base_dir`` (taken by any process) whose metadata has all of ``metadata``."""
        return await anyio.to_thread.run_sync(listed, self._base, dict(metadata or {}))


def discard(base: Path, box: Box) -> None:
    """Remove a sandbox nothing holds (a spare, or the probe's scratch one); what is left behind is logged."""
    leftovers = teardown(box, base)
    if leftovers:
        logger.warning("LocalProvider: an unused sandbox left %s behind; remove them by hand", ", ".join(leftovers))


def _restore(options: dict[str, Any]) -> LocalProvider:
    return LocalProvider(**options)


def _upload(outer: Path, *args: Any) -> None:
    """``upload``, no snapshot freezing the sandbox's files meanwhile (a write it would carry on after)."""
    with uploading(outer):
        upload(*args)


async def _transfer(
    handle: SandboxHandle,
    box: Box,
    what: str,
    move: Callable[..., None],
    inside: tuple[str, str],
    outside: tuple[str, object],
    last: Any,
) -> None:
    """A file moved either way between the sandbox path ``inside`` and the host path ``outside``,
    each ``(argument name, value)``: both checked (the sandbox's first), then ``move(root, parts,
    path, host path, last)`` in a worker thread (``last``: the owner's uid for an upload, the size
    limit for a download); a bare ``SandboxError`` or an ``OSError`` names the sandbox."""
    parts = sandbox_parts(inside[1], box.roots, inside[0])
    host = Path(check_text(fspath(outside[1], outside[0]), outside[0]))
    try:
        await anyio.to_thread.run_sync(move, box.root, parts, inside[1], host, last)
    except SandboxError as exc:
        if type(exc) is SandboxError:
            raise SandboxError(f"LocalProvider: sandbox {handle.sandbox_id!r}: {exc}") from exc
        raise
    except OSError as exc:
        raise SandboxError(f"LocalProvider: cannot {what}: {exc}") from exc
