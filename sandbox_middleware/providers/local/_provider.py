"""``LocalProvider``: real sandboxes on this machine, hardened against the commands they run."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import posixpath
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import anyio
import anyio.to_thread

from ..._errors import (
    SandboxArgumentError,
    SandboxCreateError,
    SandboxError,
    SandboxExpiredError,
    SandboxLimitError,
    SandboxNotFoundError,
)
from ..._protocol import SandboxEndpoint, SandboxExecResult, SandboxHandle, SandboxListing, SandboxSpec, SandboxStatus
from ._bwrap import BASE_PATH, HOST_ENV, OWN_ETC, SYSTEM_DIRS, BwrapCommand
from ._io import OutputCapture, check_text, download, drain, open_directory, pump, sandbox_parts, upload
from ._limits import (
    CgroupBackend,
    Limits,
    Watchdog,
    as_float,
    bind_nosuid,
    checked_limit,
    is_mount_point,
    mount_tmpfs,
    positive_number,
    probe_tmpfs,
    unmount,
)

__all__ = [
    "LocalProvider",
]

Isolation = Literal["none", "bwrap"]
LimitBackend = Literal["auto", "cgroup", "rlimit"]

DEFAULT_VIEW_ROOT = "/workspace"
# Absolute workdirs that would hide what commands need, or show the host's own.
_RESERVED_VIEWS = ("/", "/proc", "/dev", "/sys", "/etc", "/tmp", *SYSTEM_DIRS)
_MAX_TTL_S = 30 * 24 * 3600.0
# Per-sandbox host uids come from here: far above any account or container range in common use.
_UID_BASE, _UID_COUNT = 1_500_000_000, 1 << 24  # below 2**31: bwrap writes its uid map as a signed int
# Joins the sandbox's cgroups, then becomes the command: nothing it starts is ever outside them.
_JOIN_FAILED = 125
_JOIN = f'while [ "$1" != -- ]; do echo $$ > "$1" || exit {_JOIN_FAILED}; shift; done; shift; exec "$@"'
_SANDBOX_ID = re.compile(r"local-[0-9a-f]{12}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DESCRIPTOR_KEYS = (
    "provider", "sandbox_id", "root", "view_root", "env", "cwd", "ports", "expires_at", "limits", "metadata", "created",
    "uid",
)  # fmt: skip
_RECORD = "meta.json"  # beside box/, out of the sandbox's view
_MAX_ENV_NAME = 1024


@dataclass
class _Box:
    outer: Path  # the sandbox's own directory: a bounded tmpfs holding box/, tmp/ and etc/
    view_root: PurePosixPath  # the absolute workdir, or /workspace: where bwrap shows box/
    isolated: bool
    env: dict[str, str]
    cwd: tuple[str, ...]  # components below box/
    ports: tuple[int, ...]
    cgroups: list[Path]
    mounted: bool
    deadline: float | None  # time.monotonic() at which the TTL runs out
    limits: Limits
    metadata: dict[str, str]
    created: float  # time.time() at create
    uid: int | None  # the host uid its commands run as (None: this process's)
    groups: set[int] = field(default_factory=set)
    expired: bool = False
    closed: bool = False  # close() has begun
    broken: bool = False  # a close could not remove everything

    def is_expired(self) -> bool:
        return self.expired or (self.deadline is not None and time.monotonic() >= self.deadline)

    @property
    def root(self) -> Path:
        return self.outer / "box"

    @property
    def roots(self) -> tuple[PurePosixPath, ...]:
        """The absolute paths that name the sandbox root: its view path, and (without isolation) its real one."""
        return (self.view_root,) if self.isolated else (self.view_root, PurePosixPath(self.root))

    @property
    def home(self) -> PurePosixPath:
        """Where commands find the sandbox root."""
        return self.view_root if self.isolated else PurePosixPath(self.root)

    def record(self) -> dict[str, Any]:
        """What another process needs to use this sandbox (kept in ``meta.json`` and in descriptors).

        Its cgroups and mount are not part of it: they are derived from the sandbox's id and
        directory, so a forged record can never point them at anything else.
        """
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        return {
            "view_root": str(self.view_root),
            "env": self.env,
            "cwd": list(self.cwd),
            "ports": list(self.ports),
            "expires_at": None if remaining is None else time.time() + remaining,
            "limits": self.limits.record(),
            "metadata": self.metadata,
            "created": self.created,
            "uid": self.uid,
        }


class LocalProvider:
    """Sandboxes on this machine, each a fresh directory; see the README's "Security model".

    Commands run ``bash -c`` with stdin from ``/dev/null`` and a clean environment (``PATH``,
    ``HOME`` at the sandbox root, ``LANG=C.UTF-8``, then ``pass_env`` names copied from the host,
    then ``spec.env``, then the call's ``env``). Memory, process count and CPU are limited with
    cgroups where the machine allows it (rlimits otherwise; see ``mechanisms``); the writable space
    is a tmpfs of ``disk_gib`` where this process may mount one; ``ttl_s`` kills the sandbox's
    processes when it runs out. Output keeps at most ``max_output_bytes`` per stream (head and tail);
    downloads refuse files over ``max_transfer_bytes``. Transfers follow no symlink.

    ``isolation="bwrap"`` (the default; the one for untrusted code) runs each command under bubblewrap with
    no capabilities, its own user, PID, network, IPC, UTS and cgroup namespaces, and a minimal
    read-only view of the host; the sandbox directory is seen at ``spec.workdir`` when that is
    absolute, else at ``/workspace``. ``isolation="none"`` runs commands as this process's user
    with the host's whole filesystem in view: limits and the clean environment still hold, but it
    is no security boundary.
    """

    name = "local"

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
    ) -> None:
        # What pickling sends (a Ray actor builds its own provider from it): options, not sandboxes.
        self._options: dict[str, Any] = {
            "isolation": isolation, "base_dir": base_dir, "pass_env": tuple(pass_env), "memory_mib": memory_mib,
            "pids": pids, "cpu": cpu, "disk_gib": disk_gib, "max_output_bytes": max_output_bytes,
            "max_transfer_bytes": max_transfer_bytes, "ro_paths": tuple(ro_paths), "limit_backend": limit_backend,
            "connect_key": connect_key, "sandbox_uid": sandbox_uid,
        }  # fmt: skip
        if isolation not in ("none", "bwrap"):
            raise SandboxArgumentError(f"LocalProvider: isolation must be 'none' or 'bwrap', not {isolation!r}")
        if limit_backend not in ("auto", "cgroup", "rlimit"):
            raise SandboxArgumentError(
                f"LocalProvider: limit_backend must be 'auto', 'cgroup' or 'rlimit', not {limit_backend!r}"
            )
        self.isolation: Isolation = isolation
        if base_dir is None:  # a private directory of ours, not the shared temp directory itself
            base = os.path.join(tempfile.gettempdir(), f"llm-sandbox-middleware-{os.geteuid()}")
        else:
            base = check_text(_fspath(base_dir, "base_dir"), "base_dir")
        self._base = Path(base).resolve()
        for name in pass_env:
            check_text(name, "pass_env entry")
        self._pass_env = tuple(pass_env)
        self._defaults: dict[str, float | None] = {
            name: checked_limit(name, value, name)
            for name, value in (("memory_mib", memory_mib), ("pids", pids), ("cpu", cpu), ("disk_gib", disk_gib))
        }
        self._max_output = int(positive_number(max_output_bytes, "max_output_bytes", allow_none=False) or 0)
        self._max_transfer = int(positive_number(max_transfer_bytes, "max_transfer_bytes", allow_none=False) or 0)
        self._ro_paths = tuple(_checked_ro_path(path) for path in ro_paths)
        self._bwrap: BwrapCommand | None = None
        if isolation == "bwrap":
            if any(self._base == Path(d) or Path(d) in self._base.parents for d in (*SYSTEM_DIRS, *self._ro_paths)):
                raise SandboxArgumentError(
                    f"LocalProvider: base_dir {self._base} lies in a directory every sandbox sees read-only; "
                    "sandboxes could read each other's files: choose a base_dir elsewhere"
                )
            if sandbox_uid is not None and (
                isinstance(sandbox_uid, bool) or not isinstance(sandbox_uid, int) or not 0 < sandbox_uid < 2**32 - 1
            ):
                raise SandboxArgumentError(f"LocalProvider: sandbox_uid must be a non-root uid, not {sandbox_uid!r}")
            self._bwrap = BwrapCommand(ro_paths=self._ro_paths)
            if self._bwrap.drops_privileges:
                for path in map(Path, self._ro_paths):
                    _check_reachable(path)
                _check_reachable(self._base)
        self._sandbox_uid = sandbox_uid
        _prepare_base(self._base)
        self._cgroups = CgroupBackend() if limit_backend != "rlimit" else None
        if limit_backend == "cgroup" and (self._cgroups is None or not self._cgroups.resources):
            raise SandboxLimitError("LocalProvider(limit_backend='cgroup'): no writable cgroup controllers here")
        self._tmpfs = probe_tmpfs()
        if self._bwrap is not None:
            self._probe()
        self._key = connect_key if connect_key is not None else os.urandom(32)
        self._boxes: dict[str, _Box] = {}
        self._watchdog = Watchdog(self._expire)

    def __repr__(self) -> str:
        return f"LocalProvider(isolation={self.isolation!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its options: the copy is a new provider of the same configuration, holding no
        sandbox; with the same ``connect_key`` (only if one was given) it can ``connect`` to ours."""
        return (_restore, (self._options,))

    @property
    def _commands_run_as_root(self) -> bool:
        """Whether commands run as host root (RLIMIT_NPROC does not bind root)."""
        return os.geteuid() == 0 and not (self._bwrap is not None and self._bwrap.drops_privileges)

    def _new_uid(self) -> int | None:
        """The host uid a new sandbox's commands run as: its own (random in a high range, so no two
        sandboxes and no host account share it), ``sandbox_uid`` if given; None: this process's."""
        if self._bwrap is None or not self._bwrap.drops_privileges:
            return None
        if self._sandbox_uid is not None:
            return self._sandbox_uid
        return _UID_BASE + secrets.randbelow(_UID_COUNT)

    def _probe(self) -> None:
        """Start one command under bwrap in a scratch sandbox, so a machine where it cannot fails now."""
        assert self._bwrap is not None
        self._base.mkdir(parents=True, exist_ok=True)
        outer = Path(tempfile.mkdtemp(prefix="local-probe-", dir=self._base))
        uid = self._new_uid()
        try:
            _lay_out(outer, uid)
            self._bwrap.probe(outer, uid)
        finally:
            shutil.rmtree(outer, ignore_errors=True)

    @property
    def mechanisms(self) -> dict[str, str]:
        """How each limit is enforced on this machine (or ``"not enforced"``)."""
        cgroup = self._cgroups.resources if self._cgroups is not None else frozenset()
        version = f"cgroup {self._cgroups.version}" if self._cgroups is not None else ""
        root = self._commands_run_as_root
        return {
            "memory": version if "memory" in cgroup else "rlimit RLIMIT_AS (per process)",
            "pids": version if "pids" in cgroup else ("not enforced" if root else "rlimit RLIMIT_NPROC (per uid)"),
            "cpu": version if "cpu" in cgroup else "not enforced",
            "disk": "tmpfs size" if self._tmpfs else "rlimit RLIMIT_FSIZE (per file)",
            "ttl": "watchdog thread (SIGKILL)",
            "output": f"pipes, {self._max_output} bytes kept per stream",
            "isolation": self._isolation_report(),
        }

    def _isolation_report(self) -> str:
        if self._bwrap is None:
            return "none (not a security boundary)"
        if not self._bwrap.drops_privileges:
            who = "this process's uid"
        elif self._sandbox_uid is not None:
            who = f"host uid {self._sandbox_uid}"
        else:
            who = "an unprivileged host uid of its own per sandbox"
        seccomp = "seccomp filter" if self._bwrap.seccomp else "no seccomp filter (unknown architecture)"
        return f"bubblewrap as {who}, no capabilities, {seccomp}"

    # --- lifecycle -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.entrypoint:
            raise SandboxArgumentError("LocalProvider does not run spec.entrypoint; start the process with exec()")
        env = _checked_env(spec.env, "spec.env")
        if not isinstance(spec.metadata, Mapping):
            raise SandboxArgumentError(
                f"spec.metadata must be a mapping of strings, not {type(spec.metadata).__name__}"
            )
        if getattr(spec.resources, "gpu", None):
            raise SandboxLimitError("LocalProvider has no GPUs to give: drop spec.resources.gpu")
        ttl = positive_number(spec.ttl_s, "spec.ttl_s", maximum=_MAX_TTL_S)
        limits = Limits.resolve(self._defaults, spec.resources)
        self._refuse_unenforceable(limits)
        workdir = check_text(spec.workdir, "spec.workdir") if spec.workdir is not None else None
        cwd: tuple[str, ...] = ()
        if workdir is not None and PurePosixPath(workdir).is_absolute():
            view_root = _view_root(workdir)
        else:
            view_root = PurePosixPath(DEFAULT_VIEW_ROOT)
            cwd = sandbox_parts(workdir, (), "spec.workdir") if workdir else ()
        sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        metadata = {
            check_text(k, "spec.metadata key"): check_text(v, f"spec.metadata[{k!r}]") for k, v in spec.metadata.items()
        }
        box = await anyio.to_thread.run_sync(
            self._make_box, sandbox_id, limits, view_root, env, cwd, spec.ports, ttl, metadata
        )
        self._boxes[sandbox_id] = box
        if box.deadline is not None:
            self._watchdog.add(box.deadline, sandbox_id)
        return SandboxHandle(sandbox_id, self.name, {"root": str(box.root)})

    def _refuse_unenforceable(self, limits: Limits) -> None:
        cgroup = self._cgroups.resources if self._cgroups is not None else frozenset()
        refused = []
        if limits.cpu is not None and "cpu" not in cgroup:
            refused.append("cpu (needs the cgroup cpu controller)")
        if limits.pids is not None and "pids" not in cgroup and self._commands_run_as_root:
            refused.append("pids (needs the cgroup pids controller when running as root; or pass pids=None)")
        if limits.disk_bytes is not None and not self._tmpfs and "disk_gib" in limits.explicit:
            refused.append("disk_gib (needs permission to mount a tmpfs)")
        if refused:
            raise SandboxLimitError(
                f"LocalProvider cannot enforce {', '.join(refused)} on this machine; drop the limit or run where "
                f"it can be enforced (in force here: {self.mechanisms})"
            )

    def _make_box(
        self,
        sandbox_id: str,
        limits: Limits,
        view_root: PurePosixPath,
        env: dict[str, str],
        cwd: tuple[str, ...],
        ports: Iterable[int],
        ttl: float | None,
        metadata: dict[str, str],
    ) -> _Box:
        cgroups: list[Path] = []
        outer: Path | None = None
        mounted = False
        uid = self._new_uid()
        try:
            outer = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._base))
            if self._cgroups is not None:
                cgroups = self._cgroups.create(sandbox_id, limits)
            if self._tmpfs and limits.disk_bytes is not None:
                mount_tmpfs(outer, limits.disk_bytes)
                mounted = True
            elif self._tmpfs:  # unbounded, still on a mount of its own: nosuid, nodev
                bind_nosuid(outer)
                mounted = True
            _lay_out(outer, uid)
            box = _Box(
                outer=outer,
                view_root=view_root,
                isolated=self._bwrap is not None,
                env=env,
                cwd=cwd,
                ports=tuple(ports),
                cgroups=cgroups,
                mounted=mounted,
                deadline=None if ttl is None else time.monotonic() + ttl,
                limits=limits,
                metadata=metadata,
                created=time.time(),
                uid=uid,
            )
            _write_private(outer, _RECORD, json.dumps(box.record()).encode())
            with open_directory(box.root, cwd, "spec.workdir", create=True, owner=uid):
                pass
            return box
        except BaseException as exc:
            leftovers = _remove_box(outer, mounted, cgroups) if outer is not None else []
            suffix = f"; could not remove {leftovers}" if leftovers else ""
            if isinstance(exc, SandboxError):
                raise
            if isinstance(exc, OSError):
                raise SandboxCreateError(f"LocalProvider: cannot create a sandbox: {exc}{suffix}") from exc
            raise

    def _box(self, handle: SandboxHandle) -> _Box:
        box = self._boxes.get(_sandbox_id(handle))
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
            self._kill(box)

    @staticmethod
    def _kill(box: _Box) -> None:
        """Kill every process of the sandbox: through its cgroups where it has them (no pid is ever
        signalled by a number that could have been reused), else its still-running process groups."""
        if box.cgroups:
            CgroupBackend.kill(box.cgroups)
        else:
            for group in list(box.groups):
                _kill_group(group)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        box = self._boxes.get(_sandbox_id(handle))
        if box is None:
            return SandboxStatus.STOPPED if handle.provider_name == self.name else SandboxStatus.UNKNOWN
        if box.broken:
            return SandboxStatus.ERROR
        if box.is_expired():
            return SandboxStatus.STOPPED
        return SandboxStatus.RUNNING if await anyio.to_thread.run_sync(_intact, box) else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        """Kill, unmount and remove the sandbox. A handle from ``list()`` of a sandbox another process
        made is taken over here first; closing an unknown or closed sandbox does nothing."""
        sandbox_id = _sandbox_id(handle)
        box = self._boxes.get(sandbox_id)
        if box is None and handle.provider_name == self.name and _SANDBOX_ID.fullmatch(sandbox_id):
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

    def _teardown(self, box: _Box) -> list[str]:
        self._kill(box)
        # Only ever inside base_dir: the box's directory was made there by this provider, or
        # connect() checked that it lies there.
        if not box.outer.is_relative_to(self._base):
            return [f"{box.outer} (outside base_dir {self._base}; not touched)"]
        return _remove_box(box.outer, box.mounted, box.cgroups)

    async def aclose(self) -> None:
        """Close every sandbox still open here, then raise one error naming those that failed."""
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

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        check_text(command, "command")
        call_env = _checked_env(env or {}, "env")
        timeout_s = _checked_timeout(timeout_s)
        box = self._box(handle)
        if user is not None:
            raise SandboxError("LocalProvider runs commands as the current user; user= is not supported")
        parts = box.cwd
        if cwd is not None:  # the default was made at create; under bwrap a swapped one resolves inside anyway
            parts = sandbox_parts(cwd, box.roots, "cwd")
            try:
                await anyio.to_thread.run_sync(_check_directory, box.root, parts, cwd)
            except SandboxError as exc:
                raise SandboxError(
                    f"LocalProvider: cwd {cwd!r} is not a directory in sandbox {handle.sandbox_id!r}; "
                    f"create it first ({exc})"
                ) from exc
        child_env = {**self._base_env(box), **box.env, **call_env}
        deadline = timeout_s
        if box.deadline is not None:
            remaining = max(0.0, box.deadline - time.monotonic())
            deadline = remaining if deadline is None else min(deadline, remaining)
        argv, env, workdir, fds = self._argv(box, parts, command, child_env)
        try:
            return await self._run(handle, box, argv, workdir, env, deadline, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _base_env(self, box: _Box) -> dict[str, str]:
        home = str(box.home)
        env = {"PATH": BASE_PATH, "HOME": home, "LANG": "C.UTF-8"}
        if self._bwrap is None:
            env["TMPDIR"] = str(box.outer / "tmp")
        env.update({name: os.environ[name] for name in self._pass_env if name in os.environ})
        return env

    def _argv(
        self, box: _Box, parts: tuple[str, ...], command: str, env: dict[str, str]
    ) -> tuple[list[str], dict[str, str], Path, list[int]]:
        """argv, the environment of the process started, its cwd, and descriptors it must get."""
        argv = [*self._rlimit_prefix(box.limits), "bash", "-c", command]
        fds: list[int] = []
        workdir = box.root.joinpath(*parts)
        if self._bwrap is not None:
            # The command's environment travels inside bwrap's options: the host-side helpers
            # (sh, setpriv, bwrap) run with HOST_ENV only, so no LD_PRELOAD or the like reaches them.
            argv, fds = self._bwrap.argv(box.outer, box.view_root, box.view_root.joinpath(*parts), env, argv, box.uid)
            env, workdir = HOST_ENV, Path("/")
        if box.cgroups:
            argv = ["/bin/sh", "-c", _JOIN, "sh", *(str(group / "cgroup.procs") for group in box.cgroups), "--", *argv]
        return argv, env, workdir, fds

    def _rlimit_prefix(self, limits: Limits) -> list[str]:
        cgroup = self._cgroups.resources if self._cgroups is not None else frozenset()
        options = []
        if limits.memory_bytes is not None and "memory" not in cgroup:
            options.append(f"--as={limits.memory_bytes}")
        if limits.pids is not None and "pids" not in cgroup and not self._commands_run_as_root:
            options.append(f"--nproc={limits.pids}")
        if limits.disk_bytes is not None and not self._tmpfs:
            options.append(f"--fsize={limits.disk_bytes}")
        return ["prlimit", *options, "--"] if options else []

    async def _run(
        self,
        handle: SandboxHandle,
        box: _Box,
        argv: list[str],
        workdir: Path,
        env: dict[str, str],
        deadline: float | None,
        fds: list[int],
    ) -> SandboxExecResult:
        out, err = OutputCapture(self._max_output), OutputCapture(self._max_output)
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            for fd in (out_w, err_w):
                os.set_blocking(fd, True)
                with contextlib.suppress(OSError):  # fewer wake-ups per byte when a command floods
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
            try:
                process = await anyio.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, cwd=workdir, env=env,
                    start_new_session=True, pass_fds=fds,
                )  # fmt: skip
            except OSError as exc:
                raise SandboxError(f"LocalProvider: cannot start a command in {handle.sandbox_id!r}: {exc}") from exc
            finally:
                os.close(out_w)
                os.close(err_w)
            if not box.cgroups:
                box.groups.add(process.pid)
            timed_out = False
            try:
                async with anyio.create_task_group() as readers:
                    readers.start_soon(pump, out_r, out)
                    readers.start_soon(pump, err_r, err)
                    with anyio.move_on_after(deadline) as scope:
                        await process.wait()
                    if scope.cancelled_caught:
                        timed_out = True
                        _kill_group(process.pid)  # under bwrap, the namespace's init dies with it
                        with anyio.CancelScope(shield=True):
                            await process.wait()
                    # Whatever the command wrote before it ended is in the pipes now; a background
                    # child that still holds them must not hold this call.
                    readers.cancel_scope.cancel()
            except BaseException:
                _kill_group(process.pid)  # under bwrap, the namespace's init dies with it
                with anyio.CancelScope(shield=True):
                    await process.wait()
                raise
            drain(out_r, out, budget=64)
            drain(err_r, err, budget=64)
        finally:
            os.close(out_r)
            os.close(err_r)
        if box.cgroups or not _group_alive(process.pid):
            box.groups.discard(process.pid)
        code = process.returncode if process.returncode is not None else -signal.SIGKILL
        if box.closed:
            return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="closed")
        if code == _JOIN_FAILED and box.cgroups and not await anyio.to_thread.run_sync(_intact, box):
            raise SandboxNotFoundError(
                f"LocalProvider: sandbox {handle.sandbox_id!r} was removed from under this provider (closed or "
                "reaped by another process); create a new one"
            )
        if box.is_expired():
            return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="expired")
        if timed_out:
            return SandboxExecResult(out.text(), err.text(), code or -signal.SIGKILL, error_type="timeout")
        return SandboxExecResult(out.text(), err.text(), code)

    # --- files -----------------------------------------------------------------------------------

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        box = self._box(handle)
        parts = sandbox_parts(target_path, box.roots, "target_path")
        source = Path(check_text(_fspath(source_path, "source_path"), "source_path"))
        try:
            await anyio.to_thread.run_sync(upload, box.root, parts, target_path, source, box.uid)
        except OSError as exc:
            raise SandboxError(
                f"LocalProvider: cannot upload {source_path} to {target_path!r} in sandbox {handle.sandbox_id!r}: {exc}"
            ) from exc

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        box = self._box(handle)
        parts = sandbox_parts(source_path, box.roots, "source_path")
        target = Path(check_text(_fspath(target_path, "target_path"), "target_path"))
        try:
            await anyio.to_thread.run_sync(download, box.root, parts, source_path, target, self._max_transfer)
        except SandboxError as exc:
            if type(exc) is SandboxError:
                raise SandboxError(f"LocalProvider: sandbox {handle.sandbox_id!r}: {exc}") from exc
            raise
        except OSError as exc:
            raise SandboxError(
                f"LocalProvider: cannot download {source_path!r} from sandbox {handle.sandbox_id!r} "
                f"to {target_path}: {exc}"
            ) from exc

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
        assert set(body) == set(_DESCRIPTOR_KEYS)
        return {**body, "mac": self._mac(body)}

    def _mac(self, body: Mapping[str, Any]) -> str:
        return hmac.new(self._key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        """Rebuild a handle from ``serialize_handle()`` of this provider or one sharing its ``connect_key``.

        The descriptor is authenticated (HMAC-SHA256 with the provider's key) and must name a sandbox
        directory inside ``base_dir``; anything else is refused and nothing is touched.
        """
        if not isinstance(descriptor, Mapping) or "mac" not in descriptor:
            raise SandboxError("LocalProvider.connect: not a descriptor from serialize_handle() (no 'mac')")
        try:  # NeMo Gym's facades add their own keys (workdir, ports): the MAC covers only ours
            body = {key: descriptor[key] for key in _DESCRIPTOR_KEYS}
            expected = self._mac(body)
        except Exception as exc:  # a hostile mapping: raising items(), cycles, deep nesting
            raise SandboxError(f"LocalProvider.connect: descriptor is not plain JSON data: {exc!r:.200}") from exc
        mac = descriptor["mac"]
        if not isinstance(mac, str) or not _HEX64.fullmatch(mac) or not hmac.compare_digest(expected, mac):
            raise SandboxError(
                "LocalProvider.connect: the descriptor's signature does not match; it was not issued by this "
                "provider (or one sharing its connect_key), or it was altered"
            )
        sandbox_id, root = str(body["sandbox_id"]), Path(body["root"])
        outer = root.parent
        if not _SANDBOX_ID.fullmatch(sandbox_id) or not outer.name.startswith(f"{sandbox_id}-"):
            raise SandboxError(f"LocalProvider.connect: {sandbox_id!r} at {root} is not a LocalProvider sandbox")
        if outer.parent != self._base:
            raise SandboxError(
                f"LocalProvider.connect: sandbox {sandbox_id!r} lies in {outer.parent}, not in this provider's "
                f"base_dir {self._base}; connect with a provider of the same base_dir"
            )
        if not await anyio.to_thread.run_sync(_is_real_directory, root):
            raise SandboxNotFoundError(f"LocalProvider.connect: sandbox {sandbox_id!r} no longer exists at {root}")
        await anyio.to_thread.run_sync(self._adopt, sandbox_id, outer, body)
        return SandboxHandle(sandbox_id, self.name, {"root": str(root)})

    def _adopt(self, sandbox_id: str, outer: Path, record: Mapping[str, Any]) -> _Box:
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
        box = _Box(
            outer=outer,
            view_root=_view_root(check_text(record.get("view_root", DEFAULT_VIEW_ROOT), "recorded view_root")),
            isolated=self._bwrap is not None,
            env=_checked_env(record.get("env") or {}, "recorded env"),
            cwd=sandbox_parts("/".join(record.get("cwd") or ()), (), "cwd") if record.get("cwd") else (),
            ports=tuple(int(port) for port in record.get("ports") or ()),
            cgroups=self._cgroups.groups_of(sandbox_id) if self._cgroups is not None else [],
            mounted=is_mount_point(outer),
            deadline=None
            if expires_at is None
            else time.monotonic() + (positive_number(expires_at, "recorded expires_at") or 0.0) - time.time(),
            limits=Limits.from_record(record.get("limits") or [None, None, None, None]),
            metadata={
                check_text(k, "recorded metadata"): check_text(v, "recorded metadata") for k, v in metadata.items()
            },
            created=positive_number(created, "recorded created") or 0.0,
            uid=uid if self._bwrap is not None and self._bwrap.drops_privileges else None,
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
        found = await anyio.to_thread.run_sync(self._scan)
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

    def _scan(self) -> builtins.list[tuple[str, Path, dict[str, Any]]]:
        """The sandbox directories in base_dir with their records: ours only (this uid's, real
        directories, a regular 0600 record of ours), each id at most once."""
        found: dict[str, tuple[str, Path, dict[str, Any]] | None] = {}
        uid = os.geteuid()
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._base):
                sandbox_id = entry.name[:18]
                if not (_SANDBOX_ID.fullmatch(sandbox_id) and entry.name[18:19] == "-"):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                        continue
                    record = _read_record(Path(entry.path), uid)
                except (OSError, SandboxError, ValueError, RecursionError):
                    continue  # being created or removed, or not ours
                # The same id twice is a planted copy (or a bug): trust neither.
                found[sandbox_id] = None if sandbox_id in found else (sandbox_id, Path(entry.path), record)
        return [item for item in found.values() if item is not None]

    def _find(self, sandbox_id: str) -> _Box | None:
        """The sandbox ``sandbox_id`` of base_dir, adopted for ``close``; None if there is none."""
        for found_id, outer, record in self._scan():
            if found_id == sandbox_id:
                try:
                    return self._adopt(found_id, outer, record)
                except (SandboxError, ValueError, TypeError):
                    return None
        return None


def _read_record(outer: Path, uid: int) -> dict[str, Any]:
    with open_directory(outer, (), outer.name) as dir_fd:
        fd = os.open(_RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
            raise ValueError("not a record of ours")
        record = json.loads(file.read(1 << 20))
    if not isinstance(record, dict):
        raise ValueError("not a record")
    return record


def _view_root(workdir: str) -> PurePosixPath:
    """An absolute workdir, normalised ('//etc/.' is '/etc'), refused where it would cover what
    commands need or show the host's own."""
    view = PurePosixPath("/" + posixpath.normpath(workdir).lstrip("/"))
    sandbox_parts(str(view), (view,), "spec.workdir")  # NUL, over-long names
    if any(view == PurePosixPath(r) or (r != "/" and PurePosixPath(r) in view.parents) for r in _RESERVED_VIEWS):
        raise SandboxArgumentError(
            f"spec.workdir {workdir!r} would cover a system directory commands need; use e.g. /workspace"
        )
    return view


def _sandbox_id(handle: object) -> str:
    sandbox_id = getattr(handle, "sandbox_id", None)
    if not isinstance(sandbox_id, str):
        raise SandboxArgumentError(f"handle must be a SandboxHandle with a string sandbox_id, not {handle!r:.80}")
    return sandbox_id


def _intact(box: _Box) -> bool:
    return box.root.is_dir() and all(group.is_dir() for group in box.cgroups)


def _restore(options: dict[str, Any]) -> LocalProvider:
    return LocalProvider(**options)


def _lay_out(outer: Path, uid: int | None) -> None:
    """The sandbox's directory: box/ (its files), tmp/ and shm/ (its /tmp, /dev/shm), etc/ (read-only).

    ``outer`` and etc/ stay ours (root's), so nothing the sandbox's uid can do lands on a path this
    process writes by name; box/, tmp/ and shm/ are the sandbox's alone (0700, its uid).
    """
    os.chmod(outer, 0o711)  # reachable, not listable
    dir_fd = os.open(outer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in ("box", "tmp", "shm"):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            if uid is not None:
                os.chown(name, uid, uid, dir_fd=dir_fd, follow_symlinks=False)
        os.mkdir("etc", 0o755, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    for name, text in OWN_ETC.items():
        _write_private(outer / "etc", name, text.encode(), mode=0o644)


def _write_private(directory: Path, name: str, data: bytes, *, mode: int = 0o600) -> None:
    """Create ``directory/name`` afresh (never through a symlink, never an existing file) and write it."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _prepare_base(base: Path) -> None:
    """Make ``base`` (0711) or check it: ours, a real directory, writable by nobody else, since
    sandbox directories, their records and their mounts are made there."""
    try:
        base.mkdir(mode=0o711, parents=True, exist_ok=True)
        info = os.lstat(base)
    except OSError as exc:
        raise SandboxArgumentError(f"LocalProvider: cannot make base_dir {base}: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxArgumentError(
            f"LocalProvider: base_dir {base} must be a directory of this user (uid {os.geteuid()}) that no one "
            f"else can write to (it is uid {info.st_uid}, mode {oct(info.st_mode & 0o7777)}); others could plant "
            "or swap sandbox directories there. Leave base_dir unset for a private one in the temp directory"
        )


def _check_reachable(path: Path) -> None:
    """bwrap runs as the sandbox's own uid and must reach ``path``: every parent needs o+x."""
    for directory in reversed(path.parents):
        try:
            info = directory.stat()
        except FileNotFoundError:
            return
        if not info.st_mode & 0o001:
            raise SandboxArgumentError(
                f"LocalProvider: {path} (base_dir or ro_paths) is out of reach of the sandboxes' unprivileged "
                f"uids: {directory} has mode {oct(info.st_mode & 0o777)} without search permission for others; "
                "choose a path whose parents all have o+x (the temp directory's do), or chmod o+x them"
            )


def _checked_ro_path(path: str) -> str:
    check_text(path, "ro_paths entry")
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SandboxArgumentError(f"ro_paths entry {path!r} must be an absolute path that exists")
    return path


def _fspath(value: object, what: str) -> str:
    if not isinstance(value, str | os.PathLike):
        raise SandboxArgumentError(f"{what} must be a path (str or os.PathLike), not {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise SandboxArgumentError(f"{what} must be a text path, not bytes")
    return path


def _checked_timeout(timeout_s: object) -> float | None:
    """Seconds, or None for no timeout (also for infinity, or an int too large for a float)."""
    if timeout_s is None:
        return None
    value = as_float(timeout_s, "timeout_s")
    if math.isnan(value) or value < 0:
        raise SandboxArgumentError(f"timeout_s must be a number of seconds >= 0, not {timeout_s!r:.80}")
    return None if math.isinf(value) else value


def _checked_env(env: Mapping[str, str], what: str) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise SandboxArgumentError(f"{what} must be a mapping of names to strings, not {type(env).__name__}")
    checked = {}
    for name, value in env.items():
        check_text(name, f"{what} name")
        if not name or "=" in name or len(name) > _MAX_ENV_NAME:
            raise SandboxArgumentError(f"{what} name {name!r:.80} is not a valid variable name")
        checked[name] = check_text(value, f"{what}[{name!r}]")
    return checked


def _check_directory(root: Path, parts: Sequence[str], path: str | None) -> None:
    with open_directory(root, parts, path or "."):
        pass


def _is_real_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _remove_box(outer: Path, mounted: bool, cgroups: list[Path]) -> list[str]:
    """Kill, unmount and delete a sandbox's directory and cgroups; returns what could not be removed."""
    failed = CgroupBackend.remove(cgroups) if cgroups else []
    if mounted and is_mount_point(outer):  # another process may have closed it already
        try:
            unmount(outer)
        except OSError as exc:
            failed.append(f"{outer} (unmount: {exc.strerror})")

    def note(_function: Any, path: str, exc: BaseException) -> None:
        failed.append(f"{path} ({exc})")

    # rmtree walks by descriptor and never follows a symlink out of the directory.
    if not outer.exists():
        pass
    else:
        try:
            if sys.version_info >= (3, 12):
                shutil.rmtree(outer, onexc=note)
            else:
                shutil.rmtree(outer, onerror=lambda function, path, info: note(function, path, info[1]))
        except Exception as exc:  # e.g. RecursionError on a very deep tree before Python 3.13
            failed.append(f"{outer} ({type(exc).__name__}: {exc})")
    return failed


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Errors carry their public module, so `error.type` on dashboards reads e.g. sandbox_middleware.SandboxCreateError.
