"""``DockerProvider``: sandboxes as containers of a Docker daemon, over the Engine API, hardened by default.

The class alone: what each sandbox is made of lives beside it (see ``providers/README.md``).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import stat
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import anyio
import httpx

from ..._bounds import POSITIVE, Bound, Bounds
from ..._errors import (
    DockerUnavailableError,
    SandboxArgumentError,
    SandboxCreateError,
    SandboxError,
    SandboxExpiredError,
    SandboxImageNotFoundError,
    SandboxLimitError,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxSnapshotError,
    SandboxTransferLimitError,
)
from ..._protocol import (
    SandboxEndpoint,
    SandboxExecResult,
    SandboxHandle,
    SandboxListing,
    SandboxSnapshot,
    SandboxSpec,
    SandboxStatus,
)
from .._common._arguments import check_text, checked_env, fspath, sandbox_id_of
from .._common._base import ExecCall, ProviderBase
from .._common._deadlines import checked_ttl, exec_deadline
from .._common._limits import LIMIT_BOUNDS, Limits, file_max
from ..local._layers import fill, uploading
from ..local._snapshots import SNAPSHOT_ID, held, source_of
from ..local._snapshots import delete as delete_layers
from ..local._snapshots import listed as listed_layers
from . import _identity, _pools
from ._api import EngineAPI, EngineError, message_of, negotiate
from ._archive import END, TarReader, check_directory, check_stat, located, padding, tar_records, tar_stream
from ._commands import KILL_TIMEOUT_S, Commands
from ._container import (
    LABEL,
    TMP,
    BodyOf,
    Box,
    HostDir,
    Made,
    Plan,
    box_of,
    checked_metadata,
    create_body,
    keepalive_default,
    leased_uid,
    metadata_filters,
    workdir_of,
)
from ._daemons import daemon_of, identity_of, socket_of
from ._descriptors import signed, verified
from ._files import Files, root_of, usable
from ._snapshots import Snapshots, rooms
from ._spares import SUFFIX, DockerSpares, Shape, Spare, remove, shape_of, spare_body, sweep
from ._ttl import FILES, WatchdogLauncher, is_spare, taken_name

__all__ = ["DockerProvider"]

logger = logging.getLogger("sandbox_middleware")

_MiB = 1 << 20
_STATUS = {
    "running": SandboxStatus.RUNNING,
    "paused": SandboxStatus.PAUSED,
    "created": SandboxStatus.STARTING,
    "restarting": SandboxStatus.STARTING,
    "exited": SandboxStatus.STOPPED,
    "dead": SandboxStatus.STOPPED,
    "removing": SandboxStatus.STOPPED,
}


class DockerProvider(ProviderBase):
    """Sandboxes as containers of a Docker daemon (``socket``; unset, ``DOCKER_HOST``'s ``unix://`` path, else
    ``/var/run/docker.sock``), over its Engine API, under the daemon's default OCI runtime or ``runtime``
    (``"runsc"``: gVisor), checked against the daemon's ``Runtimes``; see docs/docker-provider.md.

    Each container runs ``spec.image`` with no capabilities, ``no-new-privileges``, a read-only
    root filesystem, no network (``network="none"``) unless asked, a host uid of its own (leased
    from the pool LocalProvider uses: ``_identity.py``; never root, whatever the image's ``USER``),
    bounded memory, processes and CPU, the host's kernel pools bounded (open files, ptys, TCP
    buffers, message queues, inotify: ``_pools.py``), and two bounded tmpfs
    directories, the work directory (``disk_gib``) and ``/tmp`` (``tmp_mib``), the only places it
    can write. Its main process is ``spec.entrypoint`` or a keep-alive shell loop, under Docker's
    init. ``spec.env`` travels in the API request body, never on a command line. Commands run
    ``/bin/sh -c`` (the image needs a ``/bin/sh``); output keeps at most ``max_output_bytes`` per
    stream (head and tail); a timeout kills the command's processes in the container. Transfers go
    through the archive API, regular files only, at most ``max_transfer_bytes``. ``spec.ttl_s``
    becomes a deadline label that a watchdog process enforces (``_ttl.py``), whatever the entrypoint
    and whether or not this process lives. ``spec.metadata`` becomes labels: ``list`` and ``reap``
    find the sandboxes of any process. Images are never pulled unless ``pull=True``. With
    ``prestart`` ``spares`` containers of the last created shape are kept running ahead
    (``_spares.py``), each for at most ``spare_ttl_s``, so a create of that shape takes one.
    """

    name = "docker"

    BOUNDS: ClassVar[Bounds] = Bounds(
        "DockerProvider",
        **LIMIT_BOUNDS,
        tmp_mib=POSITIVE.at_most(2**24).or_none(),
        max_output_bytes=Bound(0, strict=True, whole=True, high=2**53),
        max_transfer_bytes=Bound(0, strict=True, whole=True, high=2**53),
        request_timeout_s=POSITIVE.at_most(86400),
        nofile=Bound(16, whole=True, high=2**20),  # a shell and its command need a few descriptors
        ptys=Bound(0, whole=True, high=4096),  # kernel.pty.max is 4096 by default
        tcp_mib=POSITIVE.at_most(2**24).or_none(),
        spare_ttl_s=Bound(10, high=86400),
        spares=Bound(1, whole=True, high=64),
    )

    def __init__(
        self,
        *,
        socket: str | None = None,
        api_version: str | None = None,
        runtime: str | None = None,
        network: str = "none",
        user: str = "auto",
        memory_mib: float | None = 4096,
        pids: int | None = 1024,
        cpu: float | None = None,
        disk_gib: float | None = 4,
        tmp_mib: float | None = 512,
        max_output_bytes: int = 1 << 20,
        max_transfer_bytes: int = 256 << 20,
        pull: bool = False,
        init: bool = True,
        keepalive: Sequence[str] | None = None,
        connect_key: bytes | None = None,
        request_timeout_s: float = 300.0,
        nofile: int = 256,
        ptys: int = 0,
        tcp_mib: float | None = 64,
        prestart: bool = True,
        spare_ttl_s: float = 300.0,
        spares: int = 1,
        host_files: bool | None = None,
    ) -> None:
        self._options: dict[str, Any] = {
            "socket": socket_of(socket),  # resolved here: a pickled copy speaks to the same daemon
            "api_version": api_version,
            "runtime": runtime,
            "network": network,
            "user": user,
            "memory_mib": memory_mib,
            "pids": pids,
            "cpu": cpu,
            "disk_gib": disk_gib,
            "tmp_mib": tmp_mib,
            "max_output_bytes": max_output_bytes,
            "max_transfer_bytes": max_transfer_bytes,
            "pull": pull,
            "init": init,
            "keepalive": None if keepalive is None else tuple(keepalive),
            "connect_key": connect_key,
            "request_timeout_s": request_timeout_s,
            "nofile": nofile,
            "ptys": ptys,
            "tcp_mib": tcp_mib,
            "prestart": prestart,
            "spare_ttl_s": spare_ttl_s,
            "spares": spares,
            "host_files": host_files,
        }
        self.BOUNDS.check(locals())
        self._socket = check_text(fspath(self._options["socket"], "socket"), "socket")
        self._network = check_text(network, "network")
        if self._network == "host" or self._network.startswith("container:"):
            raise SandboxArgumentError(
                f"DockerProvider: network={network!r} shares a network namespace (the host's, or another "
                "container's) with the code the sandboxes run, which could then reach every service on its "
                "loopback (the trainer's, vLLM's, Ray's); use 'bridge' or a network of your own (see "
                "docs/docker-provider.md)"
            )
        self._fixed_user = _identity.checked_user(check_text(user, "user"))
        self._nofile, self._ptys = nofile, ptys
        self._tcp_bytes = None if tcp_mib is None else int(tcp_mib * _MiB)
        if api_version is not None:
            check_text(api_version, "api_version")
        if runtime is not None:
            check_text(runtime, "runtime")
        self._keepalive = [check_text(arg, "keepalive entry") for arg in (keepalive or keepalive_default())]
        if not self._keepalive:
            raise SandboxArgumentError("DockerProvider: keepalive must name a command (or be None for the default)")
        self._defaults: dict[str, float | None] = {
            "memory_mib": memory_mib,
            "pids": pids,
            "cpu": cpu,
            "disk_gib": disk_gib,
        }
        self._tmp_bytes = None if tmp_mib is None else int(tmp_mib * _MiB)
        self._max_output = max_output_bytes
        self._max_transfer = max_transfer_bytes
        self._pull = pull
        self._init = init
        # At least 10 s however short request_timeout_s: Podman's /info takes a second, more under load.
        version, info = negotiate(self._socket, api_version, min(max(request_timeout_s, 10.0), 30.0))
        self.api_version = version
        self._daemon = daemon_of(info, runtime, self._socket)
        if ptys and (self._daemon.kind == "podman" or not self._daemon.host_pids):
            where = (
                f"the Podman service at {self._socket} ignores the volume options that mount one"
                if self._daemon.kind == "podman"
                else "gVisor (runsc) sees the host's devpts volume through its Gofer, where /dev/ptmx opens nothing"
            )
            raise SandboxArgumentError(
                f"DockerProvider: ptys={ptys} needs a devpts of the sandbox's own, and {where} (no pty could be "
                "opened); leave ptys=0 there, or use Docker's runc for sandboxes that need terminals"
            )
        self._enforceable = {
            "memory_mib": bool(info.get("MemoryLimit")) and bool(info.get("SwapLimit", True)),
            "pids": bool(info.get("PidsLimit")),
            "cpu": bool(info.get("CpuCfsQuota")),
        }
        self._cgroup_version = str(info.get("CgroupVersion") or "1")
        options = " ".join(map(str, info.get("SecurityOptions") or ()))
        self._remapped = "name=userns" in options or "name=rootless" in options
        # Why TCP buffers go unbounded (None: bounded): v1 needs root beside the daemon to write the file.
        self._tcp_problem: str | None = None
        if self._cgroup_version == "1" and self._tcp_bytes is not None and not _pools.tcp_v1():
            self._tcp_problem = "cgroup v1 needs this provider to run as root beside the daemon"
        # The work directories as this process's tmpfs mounts on the host (``_files.py``), where it can.
        self._host_files_problem = (
            "host_files=False" if host_files is False else usable(self._socket, self._daemon, self._remapped)
        )
        if host_files and self._host_files_problem is not None:
            raise SandboxArgumentError(
                f"DockerProvider: host_files=True needs this process to mount the work directories beside the "
                f"daemon at {self._socket}, and {self._host_files_problem}; leave host_files unset (a tmpfs "
                "volume, snapshots copied) or run as root beside a local runc daemon (docs/docker-provider.md)"
            )
        identity = identity_of(info, self._socket)
        self._files = Files(root_of(identity)) if self._host_files_problem is None else None
        try:
            files_root = "" if self._files is None else str(self._files.root)
            self._watchdog = WatchdogLauncher(self._socket, version, files_root)
        except PermissionError as exc:  # its lock's directory was made by someone else (_ttl.lock_path)
            raise SandboxError(f"DockerProvider: the TTL watchdog cannot lock safely: {exc}") from None
        sweep(self._socket, version)  # the spares of processes that died without removing them
        self._sweep_files(version)
        self._api = EngineAPI(self._socket, version, request_timeout_s)  # last: nothing can fail after it
        self._commands = Commands(self._api, max_output_bytes, self._daemon)
        self._key = connect_key if connect_key is not None else os.urandom(32)
        self._boxes: dict[str, Box] = {}
        self._images: set[str] = set()  # seen on the daemon
        self._request_timeout = request_timeout_s
        self._spare_ttl = spare_ttl_s
        self._spares: DockerSpares | None = None
        self._snapshots = Snapshots(
            self._api, self.name, identity, self._watchdog.ensure, self._daemon.kind != "podman"
        )
        if prestart:  # removed with this provider, if not at aclose (or at exit)
            removal = partial(remove, self._socket, version, self._files)
            self._spares = DockerSpares(weakref.WeakMethod(self._make_spare), removal, count=spares)
            weakref.finalize(self, self._spares.close)

    def __repr__(self) -> str:
        runtime = "" if self._daemon.runtime is None else f", runtime={self._daemon.runtime!r}"
        return f"DockerProvider(socket={self._socket!r}, api_version={self.api_version!r}{runtime})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its options: the copy holds no sandbox (it can ``connect`` with the same ``connect_key``)."""
        return (_restore, (self._options,))

    @property
    def mechanisms(self) -> dict[str, str]:
        """How each limit is enforced by this daemon (or ``"not enforced"``)."""
        whole = "" if self._daemon.host_pids else ", around gVisor's Sentry: past it the whole sandbox dies"
        return {
            "memory": f"cgroup (Memory = MemorySwap){whole}" if self._enforceable["memory_mib"] else "not enforced",
            "pids": f"cgroup (PidsLimit){whole}" if self._enforceable["pids"] else "not enforced",
            "cpu": "cgroup (NanoCpus)" if self._enforceable["cpu"] else "not enforced",
            "disk": "tmpfs size of the work directory (the root filesystem is read-only)"
            + ("" if self._files is None else "; a tmpfs this process mounts on the host"),
            "ttl": "deadline label, removed by the watchdog process",
            "output": f"exec stream, {self._max_output} bytes kept per stream",
            **self._pool_mechanisms(),
        }

    def _pool_mechanisms(self) -> dict[str, str]:
        """How the host's shared kernel pools are bounded per sandbox (``_pools.py``)."""
        pids = self._defaults["pids"]
        files = f"RLIMIT_NOFILE {self._nofile} per process"
        if pids is not None:
            most = self._nofile * int(pids)
            files += (
                f" x pids {int(pids)}: at most {most} per sandbox, of fs.file-max {file_max()} "
                f"({file_max() // most} default sandboxes fill it)"
            )
        if self._cgroup_version != "1":
            tcp = f"cgroup v{self._cgroup_version} memory.max (socket buffers are charged to the sandbox's memory)"
        elif self._tcp_bytes is None:
            tcp = "not limited (tcp_mib=None)"
        elif self._tcp_problem is not None:
            tcp = f"not limited: {self._tcp_problem}"
        else:
            tcp = f"cgroup v1 memory.kmem.tcp.limit_in_bytes {self._tcp_bytes}, written from the host after start"
        if not self._daemon.host_pids:  # gVisor: the Sentry's netstack, inotify and queues, not the host kernel's
            tcp = f"gVisor's netstack: socket buffers are the Sentry's memory, in memory_mib; {tcp}"
        per_uid = "the sandbox's own uid" if self._fixed_user is None else "one uid shared by all sandboxes (user=)"
        remap = "; the daemon remaps uids: on the host, its remap range's base plus this" if self._remapped else ""
        return {
            "user": (
                "a host uid of its own per sandbox, leased host-wide from 1,500,000,000 + [0, 2^24)"
                if self._fixed_user is None
                else f"host uid:gid {self._fixed_user[0]}:{self._fixed_user[1]}, shared by all sandboxes"
            )
            + remap,
            "open files": files,
            "pty": f"devpts of its own, max={self._ptys}"
            if self._ptys
            else "none: /dev/pts is an empty read-only tmpfs",
            "tcp buffers": tcp,
            "message queues": f"RLIMIT_MSGQUEUE {_pools.MSGQUEUE_BYTES} bytes per uid: {per_uid}",
            "inotify": f"fs.inotify.max_user_instances and max_user_watches per uid: {per_uid}",
        }

    # --- lifecycle -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, from_snapshot: SandboxSnapshot | None = None) -> SandboxHandle:
        """A sandbox of ``spec``; ``from_snapshot``: its writable directories start as that snapshot's
        (``_snapshots.py``: written before it is handed out; ``_files.py``: mounted on its work directory)."""
        layered = self._files is not None and _layered(from_snapshot)
        record = None if from_snapshot is None or layered else await self._snapshots.find(from_snapshot)
        plan = await self._plan(spec)
        image_id = ""
        if from_snapshot is not None:
            image = await self._inspect_image(plan.image)
            image_id = str(image.json().get("Id")) if image.status_code == 200 else ""
        if record is not None:
            sizes = {"work": plan.limits.disk_bytes, "tmp": plan.tmp_bytes}
            self._snapshots.check_fits(record, image_id, plan.image, sizes)
        with contextlib.ExitStack() as held:
            # A snapshot without a copy: its layers kept from deletion until they are mounted on the fork.
            layers = held.enter_context(self._layers(from_snapshot, plan, image_id)) if layered else None
            if plan.deadline is not None:  # before the container exists: a worker killed from here leaves none
                self._watchdog.ensure()
            shape = shape_of(plan, self._fixed_user, self._daemon.adapt) if self._spares is not None else None
            spare = self._spares.take(shape) if self._spares is not None and shape is not None else None
            made = await self._take(spare, plan) if spare is not None else None
            if made is None:  # the spare's uid is the sandbox's, as a container made here has its own
                made = await self._build(
                    self._api, f"sandbox-{uuid.uuid4().hex[:12]}", plan, partial(create_body, plan)
                )
            container, owner, uid = made.container, made.owner, made.uid
            async with self._removed_on_failure(self._api, made, plan.image):
                # After start: a tmpfs volume written to before would be unmounted again, and its files lost.
                if record is not None:
                    await self._snapshots.restore(record, container, {"work": plan.mount, "tmp": TMP}, owner)
                if layers is not None and self._files is not None and made.files is not None:
                    outer = self._files.outer(made.files)
                    await anyio.to_thread.run_sync(fill, outer, layers, owner[0], True)
                files = [(PurePosixPath(target), text.encode()) for target, text in spec.files.items()]
                await self._seed(container, plan, owner, files)
        box = Box(
            container,
            f"{owner[0]}:{owner[1]}",
            plan.cwd,
            (plan.mount, PurePosixPath("/tmp")),
            plan.ports,
            plan.deadline,
            plan.metadata,
            time.time(),
            uid=uid,
            files=made.files,
        )
        self._boxes[container] = box
        if plan.deadline is not None:
            self._watchdog.ensure()
        if self._spares is not None and shape is not None:
            self._spares.refill(shape)
        return SandboxHandle(container, self.name, {"container": container, "name": made.name})

    @contextlib.contextmanager
    def _layers(self, snapshot: SandboxSnapshot | None, plan: Plan, image_id: str) -> Iterator[list[tuple[Path, int]]]:
        """The layers of a snapshot without a copy (``_files.py``), checked to fit a sandbox of ``plan``
        running the image ``image_id``, held from deletion for the block (blocking, for an instant)."""
        assert self._files is not None and snapshot is not None
        with held(self._files.root, snapshot, self.name) as layers:
            taken_of = source_of(self._files.root, snapshot, self.name)
            if image_id != taken_of:
                raise SandboxSnapshotError(
                    f"DockerProvider: snapshot {snapshot.snapshot_id} was taken of a sandbox of image "
                    f"{taken_of[:19]}, and spec.image {plan.image!r} is {image_id[:19]}: a sandbox from a snapshot "
                    "runs the image the snapshot was taken of; give the spec that image"
                )
            if not plan.host_files or (plan.limits.disk_bytes or 0) < snapshot.size_bytes:
                raise SandboxSnapshotError(
                    f"DockerProvider: snapshot {snapshot.snapshot_id} holds {snapshot.size_bytes} bytes of the work "
                    f"directory, more than the new sandbox's disk_gib ({plan.limits.disk_bytes} bytes); give it more"
                )
            yield layers

    async def _build(self, api: EngineAPI, name: str, plan: Plan, body_of: BodyOf) -> Made:
        """A started container ``name`` of ``plan``, its body ``body_of`` gives for its owner (``create_body``,
        or ``_spares.spare_body``), its uid leased and claimed, its TCP buffers bounded: the one path by
        which every sandbox and every spare is made."""
        made = await self._create_container(api, name, plan, body_of)
        async with self._removed_on_failure(api, made, plan.image):
            await api.call("POST", f"/containers/{made.container}/start", f"start container {name}")
            await self._bound_tcp(api, made.container, plan)
        return made

    @contextlib.asynccontextmanager
    async def _removed_on_failure(self, api: EngineAPI, made: Made, image: str) -> AsyncIterator[None]:
        """Remove the container ``made`` (shielded, bounded) and free its uid if the block fails; the
        daemon's error becomes a create error."""
        container = made.container
        try:
            yield
        except BaseException as exc:
            left = f"; container {container[:12]} was not removed (its labels let reap find it)"
            # A removal that fails too (the daemon died) must not replace the start's error.
            with anyio.CancelScope(shield=True), anyio.move_on_after(30), contextlib.suppress(SandboxError):
                await self._remove(container, api, made.files)
                left = ""
                if made.uid is not None:
                    await _identity.release(made.uid, self._socket, (container, made.name))
            if isinstance(exc, EngineError | DockerUnavailableError):
                raise SandboxCreateError(
                    f"DockerProvider: cannot start a container of {image!r}: {exc}{left}{self._unmapped(exc)}"
                ) from exc
            raise

    def _make_spare(self, shape: Shape) -> Spare:
        """A spare of ``shape`` (blocking, in the maker thread: its own event loop and connections)."""
        return anyio.run(self._spare_of, shape.plan)

    async def _spare_of(self, plan: Plan) -> Spare:
        api = EngineAPI(self._socket, self.api_version, self._request_timeout)
        try:
            name = f"sandbox-{uuid.uuid4().hex[:12]}"
            made = time.time()
            until = made + self._spare_ttl
            self._watchdog.ensure()  # it removes the spare when stale, whether or not this process lives
            # Its own uid, leased and claimed (for its name, then its id) as any sandbox's; a rename keeps it.
            built = await self._build(api, name + SUFFIX, plan, partial(spare_body, plan, until))
            async with self._removed_on_failure(api, built, plan.image):
                info = await api.inspect(built.container, f"inspect spare {name}") or {}
            return Spare(built, name, str(info.get("Image")), made, until)
        finally:
            await api.aclose()

    async def _take(self, spare: Spare, plan: Plan) -> Made | None:
        """Make ``spare`` the caller's: renamed to say when it was taken and its deadline, once it is seen
        running the image its name now names; the container under its new name, with its uid, claimed by
        id, now the sandbox's (None: it is not usable)."""
        try:
            image = await self._inspect_image(plan.image)
            info = await self._api.inspect(spare.built.container, f"inspect spare {spare.name}") or {}
            running = bool((info.get("State") or {}).get("Running")) and info.get("Image") == spare.image
            if image.status_code == 200 and image.json().get("Id") == spare.image and running:
                name = taken_name(spare.name, time.time(), plan.deadline)
                what = f"take spare {spare.name}"
                params = {"name": name}
                reply = await self._api.call(
                    "POST", f"/containers/{spare.built.container}/rename", what, params=params, ok=(404,)
                )
                if reply.status_code != 404:
                    return dataclasses.replace(spare.built, name=name)
        except SandboxError as exc:  # a create of its own says what the daemon says
            logger.debug("DockerProvider: spare %s not taken: %s", spare.name, exc)
        except BaseException:  # cancelled: nobody holds it now
            self._discard(spare)
            raise
        self._discard(spare)
        return None

    def _discard(self, spare: Spare) -> None:
        """Remove a spare taken from the kept one but not handed out, in the background."""
        if self._spares is not None:
            self._spares.discard(spare)

    async def _plan(self, spec: SandboxSpec) -> Plan:
        if not spec.image:
            raise SandboxArgumentError("DockerProvider needs spec.image, the image to run: SandboxSpec(image=...)")
        image = check_text(spec.image, "spec.image").removeprefix("docker://")
        env = checked_env(spec.env, "spec.env")
        metadata = checked_metadata(spec.metadata, "spec.metadata")
        if getattr(spec.resources, "gpu", None):
            raise SandboxLimitError("DockerProvider gives no GPUs: drop spec.resources.gpu")
        ttl = checked_ttl(spec.ttl_s)
        limits = Limits.resolve(self._defaults, spec.resources)
        refused = [
            name
            for name, field in _LIMIT_FIELDS.items()
            if getattr(limits, field) is not None and not self._enforceable[name]
        ]
        if refused:
            raise SandboxLimitError(
                f"DockerProvider: the daemon at {self._socket} cannot enforce {', '.join(refused)} (its /info says "
                f"so; cgroup controllers missing?); pass {' '.join(f'{name}=None' for name in refused)} to run "
                "without, or use a daemon that enforces them"
            )
        entrypoint = [check_text(arg, "spec.entrypoint entry") for arg in spec.entrypoint] if spec.entrypoint else None
        if spec.ports and self._network == "none":
            raise SandboxArgumentError(
                f"spec.ports {list(spec.ports)} need a network, and this provider has network='none'; build it "
                "with network='bridge' (published on 127.0.0.1 only)"
            )
        mount, cwd = workdir_of(spec.workdir)
        await self._check_image(image)
        env = {"HOME": str(mount), **env}
        return Plan(
            image=image,
            mount=mount,
            cwd=cwd,
            env=env,
            entrypoint=entrypoint,
            keepalive=self._keepalive,
            limits=limits,
            tmp_bytes=self._tmp_bytes,
            network=self._network,
            ports=tuple(spec.ports),
            deadline=None if ttl is None else time.time() + ttl,
            metadata=metadata,
            init=self._init,
            nofile=self._nofile,
            nproc=limits.pids if self._fixed_user is None else None,  # per uid: only a uid of its own
            ptys=self._ptys,
            tcp_bytes=self._tcp_bytes if self._cgroup_version == "1" else None,
            remapped=self._remapped,
            host_files=self._files is not None and limits.disk_bytes is not None,
        )

    async def check_image(self, image: str) -> None:
        """Raise ``SandboxImageNotFoundError`` unless ``image`` is on the daemon (pulled first with
        ``pull=True``), as a create of it would: asked once before many creates (``sandbox-middleware run``)."""
        await self._check_image(check_text(image, "image").removeprefix("docker://"))

    async def _check_image(self, image: str) -> None:
        """Raise ``SandboxImageNotFoundError`` unless ``image`` is on the daemon (pulled with ``pull=True``);
        an image found is remembered."""
        if image in self._images:
            return
        reply = await self._inspect_image(image)
        if reply.status_code == 404:
            if not self._pull:
                raise SandboxImageNotFoundError(
                    f"DockerProvider: image {image!r} is not on the daemon at {self._socket}; build or load it "
                    "(docker build / docker load / docker import), or pass pull=True to pull missing images"
                )
            await self._pull_image(image)
            reply = await self._inspect_image(image)
            if reply.status_code == 404:
                raise SandboxImageNotFoundError(
                    f"DockerProvider: pulled image {image!r}, yet the daemon at {self._socket} has no image of that "
                    "name (another platform's, or a tag resolved differently?); name the image as the daemon lists it"
                )
        self._images.add(image)

    async def _inspect_image(self, image: str) -> httpx.Response:
        try:
            return await self._api.call("GET", f"/images/{image}/json", f"inspect image {image!r}", ok=(404,))
        except DockerUnavailableError as exc:
            raise SandboxCreateError(str(exc)) from exc

    async def _pull_image(self, image: str) -> None:
        what = f"pull image {image!r}"
        try:
            async with self._api.stream("POST", "/images/create", what, params={"fromImage": image}) as reply:
                async for line in reply.aiter_lines():
                    if '"error"' in line:
                        raise SandboxImageNotFoundError(f"DockerProvider: cannot {what}: {line[:500]}")
        except EngineError as exc:
            raise SandboxImageNotFoundError(f"DockerProvider: cannot {what}: {exc.message}") from exc
        except DockerUnavailableError as exc:
            raise SandboxCreateError(str(exc)) from exc

    async def _create_container(self, api: EngineAPI, name: str, plan: Plan, body_of: BodyOf) -> Made:
        """Create (not start) the container ``name`` of ``plan``, whose body ``body_of`` gives for its owner,
        as a host uid of its own: leased from the host's pool and claimed for the container (by ``name``,
        then by its id) before and after the daemon is asked (``_identity.py``), or the provider's fixed
        ``user=``."""
        what = f"create a container of {plan.image!r}"
        lease = await _identity.lease() if self._fixed_user is None else None
        owner = (lease.uid, lease.uid) if lease is not None else self._fixed_user
        assert owner is not None
        files: HostDir | None = None
        try:
            if lease is not None:
                lease.claim(self._socket, name)  # a create whose reply is lost holds it by name
            with contextlib.ExitStack() as held:
                if plan.host_files and self._files is not None and plan.limits.disk_bytes is not None:
                    key = held.enter_context(self._files.made(plan.limits.disk_bytes, owner))
                    files = HostDir(key, str(self._files.outer(key) / "box"))
                body = self._daemon.adapt(body_of(owner, lease is not None, files))  # a spare's too: Podman's needs
                reply = await api.call("POST", "/containers/create", what, params={"name": name}, body=body)
                container = str(reply.json()["Id"])
        except EngineError as exc:
            if lease is not None:  # refused (4xx): no container was made; a 5xx may have left one, which holds it
                lease.release() if exc.status < 500 else lease.keep()
            raise self._refused(exc, plan.image, what) from exc
        except BaseException as exc:
            if lease is not None:  # it may exist: its claim holds the uid until the daemon says it does not
                lease.keep()
            if isinstance(exc, DockerUnavailableError):  # its response may be lost: the labels let reap find it
                raise SandboxCreateError(f"DockerProvider: {exc}") from exc
            raise
        if lease is not None:
            lease.claim(self._socket, container)
            lease.keep()
        return Made(container, name, owner, None if lease is None else lease.uid, None if files is None else files.key)

    def _unmapped(self, exc: SandboxError) -> str:
        """What to do where a remapping daemon has no host uid for the sandbox's."""
        if not self._remapped or "unmapped user" not in str(exc):
            return ""
        return (
            f"; the daemon at {self._socket} remaps uids (userns-remap or rootless) through a range without "
            "this sandbox's uid: give its remap user a subordinate range of at least 1,516,777,216 uids "
            "(/etc/subuid, /etc/subgid), or pass user='UID:GID' inside the range (docs/docker-provider.md)"
        )

    def _refused(self, exc: EngineError, image: str, what: str) -> SandboxError:
        """The public error of a create the daemon refused."""
        if exc.status == 404:
            self._images.discard(image)
            return SandboxImageNotFoundError(
                f"DockerProvider: image {image!r} is not on the daemon at {self._socket} (removed since it was "
                "inspected?); build or load it again"
            )
        if exc.status == 400:
            return SandboxArgumentError(f"DockerProvider: the daemon refused the container: {exc.message}")
        return SandboxCreateError(f"DockerProvider: cannot {what}: {exc.message}")

    async def _bound_tcp(self, api: EngineAPI, container: str, plan: Plan) -> None:
        """On cgroup v1, bound the started container's TCP buffers from the host (``_pools.bound_tcp``);
        where this provider cannot, say so once and in ``mechanisms``."""
        if plan.tcp_bytes is None or self._tcp_problem is not None:
            return
        info = await api.inspect(container, f"inspect container {container[:12]}") or {}
        pid = int((info.get("State") or {}).get("Pid") or 0)
        problem = _pools.bound_tcp(container, pid, plan.tcp_bytes) if pid else "the container has no process"
        if problem is not None and info:
            self._tcp_problem = problem
            logger.warning("DockerProvider: the sandboxes' TCP buffers are not bounded: %s", problem)

    async def _seed(
        self, container: str, plan: Plan, owner: tuple[int, int], files: list[tuple[PurePosixPath, bytes]]
    ) -> None:
        """The cwd below the work directory, and ``spec.files``, in one archive per writable directory."""
        entries: list[tuple[PurePosixPath, tuple[str, ...], bytes | None]] = []
        mounts = (plan.mount, PurePosixPath("/tmp"))
        if plan.cwd != plan.mount:
            entries.append((plan.mount, plan.cwd.relative_to(plan.mount).parts, None))
        for target, data in files:
            mount, parts = located(str(target), plan.cwd, mounts, f"spec.files[{str(target)!r}]")
            entries.append((mount, parts, data))
        for mount in mounts:
            chunks = []
            for _, parts, contents in (entry for entry in entries if entry[0] == mount):
                chunks += tar_records(parts, owner, None if contents is None else len(contents))
                chunks += [] if contents is None else [contents, padding(len(contents))]
            if chunks:
                await self._api.call(
                    "PUT",
                    f"/containers/{container}/archive",
                    f"write spec.files to {mount}",
                    params={"path": str(mount), "noOverwriteDirNonDir": "true"},
                    content=b"".join(chunks) + END,
                )

    async def _remove(self, container: str, api: EngineAPI | None = None, files: str | None = None) -> None:
        """Force-remove ``container`` and its volumes, then its work directory on the host (``files``: its
        key); one already gone, or being removed by another process (the TTL watchdog, a reaper, a second
        close), is done."""
        what = f"remove container {container[:12]}"
        reply = await (api or self._api).call(
            "DELETE", f"/containers/{container}", what, params={"force": "true", "v": "true"}, ok=(404, 409)
        )
        if reply.status_code == 409 and "already in progress" not in (message := message_of(reply)):
            raise EngineError(409, message, what)
        if files is not None and self._files is not None:
            with anyio.CancelScope(shield=True):
                left = await anyio.to_thread.run_sync(self._files.remove, files)
            if left:
                raise SandboxError(f"DockerProvider: {what}: its work directory on the host was not removed: {left}")

    def _sweep_files(self, version: str) -> None:
        """Remove the work directories on the host that no container names, and half-made or deleted
        snapshots' files (blocking)."""
        if self._files is not None:
            left = self._files.sweep(self._socket, version)
            if left:
                logger.warning("DockerProvider: leftover work directories not removed: %s", "; ".join(left))

    def _box(self, handle: SandboxHandle) -> Box:
        box = self._boxes.get(sandbox_id_of(handle))
        if box is None or box.closed:
            raise SandboxNotFoundError(
                f"DockerProvider: no live sandbox {handle.sandbox_id!r} (never created here, or closed); "
                "another process's sandbox is reached with connect()"
            )
        if box.is_expired():
            raise SandboxExpiredError(
                f"DockerProvider: sandbox {handle.sandbox_id!r} expired (its ttl_s ran out) and its container is "
                "removed; create a new one"
            )
        return box

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        sandbox_id = sandbox_id_of(handle)
        box = self._boxes.get(sandbox_id)
        if handle.provider_name != self.name:
            return SandboxStatus.UNKNOWN
        if box is not None and (box.closed or box.is_expired()):
            return SandboxStatus.STOPPED
        try:
            info = await self._api.inspect(sandbox_id, f"status of {sandbox_id[:12]}")
        except DockerUnavailableError:
            return SandboxStatus.UNKNOWN
        if info is None or _labels(info).get(LABEL) != "1":
            return SandboxStatus.STOPPED
        return _STATUS.get(str((info.get("State") or {}).get("Status")), SandboxStatus.UNKNOWN)

    async def close(self, handle: SandboxHandle) -> None:
        """Remove the container and its volumes. A handle from ``list()`` of another process's sandbox
        is checked to be one of ours first; closing an unknown or closed sandbox does nothing."""
        sandbox_id = sandbox_id_of(handle)
        box = self._boxes.get(sandbox_id)
        if box is None:
            if handle.provider_name != self.name:
                return
            info = await self._api.inspect(sandbox_id, f"close {sandbox_id[:12]}")
            if info is None or _labels(info).get(LABEL) != "1":
                return  # gone, or not a sandbox of ours: never touched
            sandbox_id, names = str(info["Id"]), [str(info.get("Name") or "").lstrip("/")]
            uid, files = leased_uid(_labels(info)), _labels(info).get(FILES)
        else:
            box.closed = True  # a command running now returns error_type="closed"
            uid, names, files = box.uid, [], box.files
        try:
            await self._remove(sandbox_id, files=files)
        except BaseException:
            if box is not None:  # not removed: status asks the daemon again, and close can be retried
                box.closed = False
            raise
        self._boxes.pop(sandbox_id, None)
        if uid is not None:  # removed (or being removed: a claim is freed only once the daemon says it is gone)
            await _identity.release(uid, self._socket, (sandbox_id, *names))

    async def aclose(self) -> None:
        """Remove the spare, close every sandbox still open here, then the connection pool; one error names
        those that failed."""
        failures = []
        if self._spares is not None:  # shielded: a cancelled aclose still removes it (bounded by its make's wait)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._spares.close)
        try:
            for sandbox_id in list(self._boxes):
                try:
                    await self.close(SandboxHandle(sandbox_id, self.name))
                except SandboxError as exc:
                    failures.append(str(exc))
            if self._files is not None:  # what dead processes and removals elsewhere left on the host
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await anyio.to_thread.run_sync(self._sweep_files, self.api_version)
        finally:  # cancelled or not: the connection pool is released
            self._watchdog.reap()
            with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_S):
                await self._api.aclose()
        if failures:
            raise SandboxError(f"DockerProvider.aclose: {len(failures)} sandboxes not removed: {'; '.join(failures)}")

    # --- commands ----------------------------------------------------------------------------------

    async def _exec(self, handle: SandboxHandle, call: ExecCall) -> SandboxExecResult:
        box = self._box(handle)
        workdir = box.cwd if call.cwd is None else box.cwd / check_text(call.cwd, "cwd")
        as_user = _identity.exec_user(call.user, box.user, box.container)
        deadline = exec_deadline(call.timeout_s, box.remaining())
        return await self._commands.run(handle, box, call.command, call.env, workdir, as_user, deadline)

    # --- files -----------------------------------------------------------------------------------

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        box = self._box(handle)
        mount, parts = _file_in(box, target_path, "target_path")
        source = check_text(fspath(source_path, "source_path"), "source_path")
        what = f"upload {source_path} to {target_path!r} in sandbox {handle.sandbox_id[:12]}"
        try:
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise SandboxError(f"DockerProvider: cannot {what}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SandboxError(f"DockerProvider: cannot {what}: the source is not a regular file")
            if info.st_size > self._max_transfer:
                raise SandboxTransferLimitError(
                    f"DockerProvider: cannot {what}: it is {info.st_size} bytes, over max_transfer_bytes="
                    f"{self._max_transfer}"
                )
            os.set_blocking(fd, True)
            uid, _, gid = box.user.partition(":")
            owner = int(uid), int(gid or uid)
            with contextlib.ExitStack() as held:
                if box.files is not None and self._files is not None and mount == box.mounts[0]:
                    # no snapshot freezes it meanwhile; waited for in a thread: a snapshot's count holds it
                    lock = uploading(self._files.outer(box.files))
                    await anyio.to_thread.run_sync(held.enter_context, lock)
                await self._api.call(
                    "PUT",
                    f"/containers/{box.container}/archive",
                    what,
                    params={"path": str(mount), "noOverwriteDirNonDir": "true"},
                    content=tar_stream(fd, info.st_size, parts, owner),
                )
        except EngineError as exc:
            if "cannot overwrite non-directory" in exc.message or (  # Docker's, Podman's
                "copier: put: error creating" in exc.message and exc.message.endswith("file exists")
            ):
                raise SandboxPathError(
                    f"DockerProvider: cannot {what}: a component of {target_path!r} is not a directory (a symlink?); "
                    "transfers never follow one: name a path through real directories"
                ) from exc
            raise SandboxError(f"DockerProvider: cannot {what}: {exc.message}") from exc
        finally:
            os.close(fd)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        box = self._box(handle)
        mount, parts = _file_in(box, source_path, "source_path")
        target = Path(check_text(fspath(target_path, "target_path"), "target_path"))
        what = f"download {source_path!r} from sandbox {handle.sandbox_id[:12]} to {target_path}"
        archive = f"/containers/{box.container}/archive"
        try:
            for depth in range(1, len(parts) + 1):  # the daemon follows a symlink in a parent: refuse one
                path = str(mount.joinpath(*parts[:depth]))
                head = await self._api.call("HEAD", archive, what, params={"path": path}, ok=(404,))
                if head.status_code == 404:
                    raise SandboxError(
                        f"DockerProvider: {source_path!r} is not a file in sandbox {handle.sandbox_id[:12]}"
                    )
                header = head.headers.get("X-Docker-Container-Path-Stat")
                if depth < len(parts):
                    check_directory(header, source_path, path)
                else:
                    check_stat(header, source_path, self._max_transfer)
            async with self._api.stream("GET", archive, what, params={"path": path}) as reply:
                await TarReader(source_path, target, self._max_transfer).read(reply.aiter_raw())
        except EngineError as exc:
            raise SandboxError(f"DockerProvider: cannot {what}: {exc.message}") from exc

    # --- capabilities ------------------------------------------------------------------------------

    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint:
        box = self._box(handle)
        if port not in box.ports:
            raise SandboxError(
                f"port {port} was not declared in the spec of sandbox {handle.sandbox_id!r} "
                f"(declared: {list(box.ports)})"
            )
        info = await self._api.inspect(box.container, f"endpoint of {handle.sandbox_id[:12]}") or {}
        bindings = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{port}/tcp") or []
        for binding in bindings:
            if binding.get("HostIp") == "127.0.0.1" and binding.get("HostPort"):
                return SandboxEndpoint(f"http://127.0.0.1:{int(binding['HostPort'])}")
        raise SandboxError(f"DockerProvider: no 127.0.0.1 port is published for {port} of {handle.sandbox_id!r}")

    async def pause(self, handle: SandboxHandle) -> None:
        """Freeze every process of the sandbox (the cgroup freezer); its TTL keeps running."""
        box = self._box(handle)
        await self._api.call("POST", f"/containers/{box.container}/pause", f"pause {handle.sandbox_id[:12]}")
        box.paused = True

    async def resume(self, handle: SandboxHandle) -> None:
        box = self._box(handle)
        await self._api.call("POST", f"/containers/{box.container}/unpause", f"resume {handle.sandbox_id[:12]}")
        box.paused = False

    async def _snapshot(
        self, handle: SandboxHandle, paths: builtins.list[str] | None, metadata: dict[str, str]
    ) -> SandboxSnapshot:
        """The sandbox's work directory (or ``paths`` in its writable directories) as an image: consistent as
        of one moment (the sandbox is paused while it is read), symlinks kept as links (``_snapshots.py``)."""
        box = self._box(handle)
        info = await self._api.inspect(box.container, f"inspect sandbox {handle.sandbox_id[:12]} for a snapshot")
        if info is None:
            raise SandboxNotFoundError(
                f"DockerProvider: sandbox {handle.sandbox_id!r} was removed; nothing to snapshot"
            )
        image = str(info.get("Image"))
        sizes = rooms(info.get("HostConfig") or {})
        if box.files is not None and self._files is not None:
            outer = self._files.outer(box.files)
            if paths is None:
                pid = int((info.get("State") or {}).get("Pid") or 0)
                tini = bool((info.get("HostConfig") or {}).get("Init"))
                rotated = await self._rotated(box, outer, pid, tini, metadata, image)
                if rotated is not None:
                    return rotated
            room = os.statvfs(outer)
            sizes[str(box.mounts[0])] = room.f_blocks * room.f_frsize
        return await self._snapshots.take(box, image, paths, metadata, sizes)

    async def _rotated(
        self, box: Box, outer: Path, pid: int, tini: bool, metadata: dict[str, str], image: str
    ) -> SandboxSnapshot | None:
        """The work directory on the host made a snapshot without a copy (``_files.py``), the sandbox paused
        meanwhile; None where it cannot be now (the caller copies): one paused already (by its user, or by a
        command's kill, whose resume could come mid-way). Resumed after, or the snapshot is deleted: a
        sandbox stopped meanwhile (killed, removed) leaves none."""
        assert self._files is not None and box.files is not None
        what = f"pause sandbox {box.container[:12]} for a snapshot"
        if (await self._api.call("POST", f"/containers/{box.container}/pause", what, ok=(409,))).status_code >= 400:
            return None
        snapshot = None
        try:
            uid = int(box.user.partition(":")[0])
            take = partial(self._files.take, box.files, pid, tini, uid, metadata, image, str(box.cwd), self.name)
            snapshot = await anyio.to_thread.run_sync(take) if pid else None
            return snapshot
        finally:
            with anyio.CancelScope(shield=True), anyio.fail_after(60):
                try:
                    await self._api.call("POST", f"/containers/{box.container}/unpause", f"resume {box.container[:12]}")
                except EngineError as exc:
                    if snapshot is not None:
                        await anyio.to_thread.run_sync(delete_layers, self._files.root, snapshot, self.name)
                    raise SandboxSnapshotError(
                        f"DockerProvider: sandbox {box.container[:12]} stopped during its snapshot ({exc.message}); "
                        "no snapshot is kept: take one of a running sandbox"
                    ) from exc

    async def delete_snapshot(self, snapshot: SandboxSnapshot) -> None:
        """Remove the snapshot's image (only an image this provider labelled as that snapshot), or its layers
        on the host (``_files.py``); its forks run on."""
        if self._files is None or not _layered(snapshot):
            await self._snapshots.delete(snapshot)
            return
        left = await anyio.to_thread.run_sync(delete_layers, self._files.root, snapshot, self.name)
        if left:
            raise SandboxSnapshotError(f"DockerProvider: snapshot {snapshot.snapshot_id} was deleted; left: {left}")

    async def list_snapshots(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxSnapshot]:
        """This provider's snapshots on its daemon (and on this host, ``_files.py``), taken by any process,
        whose metadata has all of ``metadata``."""
        found = await self._snapshots.listed(metadata)
        if self._files is not None:
            wanted = checked_metadata(metadata if metadata is not None else {}, "metadata")
            kept = await anyio.to_thread.run_sync(listed_layers, self._files.root, wanted)
            found = sorted([*found, *(item for item in kept if item.provider == self.name)], key=lambda s: s.created)
        return found

    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        box = self._box(handle)
        return signed(self._key, self.name, box.container, self._socket)

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        """Rebuild a handle from ``serialize_handle()`` of this provider or one sharing its ``connect_key``.

        The descriptor is authenticated (HMAC-SHA256) and must name a container of ours on this
        provider's daemon; what the handle needs is read back from that container's labels.
        """
        body = verified(self._key, descriptor)
        if body["socket"] != self._socket:
            raise SandboxError(
                f"DockerProvider.connect: the sandbox lives on the daemon at {body['socket']}, not {self._socket}; "
                "connect with a provider of that socket"
            )
        sandbox_id = body["sandbox_id"]
        info = await self._api.inspect(sandbox_id, f"connect to {sandbox_id[:12]}")
        box = box_of(sandbox_id, _labels(info), None, str(info.get("Name"))) if info is not None else None
        if box is None or str((info or {}).get("Id")) != sandbox_id:
            raise SandboxNotFoundError(f"DockerProvider.connect: no sandbox container {sandbox_id[:12]} on this daemon")
        self._boxes.setdefault(sandbox_id, box)
        if box.deadline is not None:
            self._watchdog.ensure()
        return SandboxHandle(sandbox_id, self.name, {"container": sandbox_id})

    async def list(self, *, metadata: Mapping[str, str] | None = None) -> builtins.list[SandboxListing]:
        """Every sandbox container of this daemon (made by any process) whose metadata has all of ``metadata``.

        Listing changes nothing: a listed handle can be given to ``close``; to run commands in
        another process's sandbox, ``connect`` its descriptor.
        """
        wanted = checked_metadata(metadata or {}, "metadata")
        filters = json.dumps({"label": metadata_filters(wanted)})
        params = {"all": "1", "filters": filters}
        reply = await self._api.call("GET", "/containers/json", "list sandboxes", params=params)
        listings = []
        for container in reply.json():
            labels, name = container.get("Labels") or {}, str((container.get("Names") or [""])[0])
            box = (
                None
                if is_spare(labels, name)
                else box_of(str(container.get("Id")), labels, container.get("Created"), name)
            )
            if box is None or any(box.metadata.get(key) != value for key, value in wanted.items()):
                continue
            created = float(box.created) if isinstance(box.created, int | float) else None
            handle = SandboxHandle(box.container, self.name, {"container": box.container})
            listings.append(SandboxListing(handle, box.metadata, created))
        return listings


_LIMIT_FIELDS = {"memory_mib": "memory_bytes", "pids": "pids", "cpu": "cpu"}


def _file_in(box: Box, path: str, name: str) -> tuple[PurePosixPath, tuple[str, ...]]:
    """The writable directory a transfer's sandbox ``path`` lies in, and its components: a file's."""
    mount, parts = located(path, box.cwd, box.mounts, name)
    if not parts:
        raise SandboxError(
            f"DockerProvider: {name} {path!r} names a directory of the sandbox, not a file: transfers copy one "
            "regular file (archive a directory in the sandbox first)"
        )
    return mount, parts


def _layered(snapshot: object) -> bool:
    """Whether ``snapshot`` names a snapshot without a copy (``_files.py``: LocalProvider's ids), not an image."""
    return isinstance(snapshot, SandboxSnapshot) and SNAPSHOT_ID.fullmatch(snapshot.snapshot_id) is not None


def _labels(info: Mapping[str, Any]) -> Mapping[str, str]:
    """A container's labels from its ``GET /containers/{id}/json``."""
    return (info.get("Config") or {}).get("Labels") or {}


def _restore(options: dict[str, Any]) -> DockerProvider:
    return DockerProvider(**options)
