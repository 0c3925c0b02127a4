"""``DockerProvider``: sandboxes as containers of a Docker daemon, over the Engine API, hardened by default.

The class alone: what each sandbox is made of lives beside it (see ``providers/README.md``).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Mapping, Sequence
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
    SandboxTransferLimitError,
)
from ..._protocol import SandboxEndpoint, SandboxExecResult, SandboxHandle, SandboxListing, SandboxSpec, SandboxStatus
from .._common._arguments import check_text, checked_env, checked_exec, fspath, sandbox_id_of
from .._common._deadlines import checked_ttl, exec_deadline
from .._common._limits import LIMIT_BOUNDS, Limits
from ._api import EngineAPI, EngineError, message_of, negotiate
from ._archive import END, TarReader, check_directory, check_stat, located, padding, tar_records, tar_stream
from ._commands import KILL_TIMEOUT_S, Commands
from ._container import (
    LABEL,
    Box,
    Plan,
    box_of,
    checked_metadata,
    create_body,
    keepalive_default,
    metadata_filters,
    workdir_of,
)
from ._daemons import daemon_of, socket_of
from ._descriptors import signed, verified
from ._ttl import WatchdogLauncher

__all__ = ["DockerProvider"]

logger = logging.getLogger("sandbox_middleware")

_MiB = 1 << 20
_NOBODY = "65534:65534"
_ROOT_USERS = ("", "root", "0", "0:0")
_STATUS = {
    "running": SandboxStatus.RUNNING,
    "paused": SandboxStatus.PAUSED,
    "created": SandboxStatus.STARTING,
    "restarting": SandboxStatus.STARTING,
    "exited": SandboxStatus.STOPPED,
    "dead": SandboxStatus.STOPPED,
    "removing": SandboxStatus.STOPPED,
}


class DockerProvider:
    """Sandboxes as containers of a Docker daemon (``socket``; unset, ``DOCKER_HOST``'s ``unix://`` path, else
    ``/var/run/docker.sock``), over its Engine API, under the daemon's default OCI runtime or ``runtime``
    (``"runsc"``: gVisor), checked against the daemon's ``Runtimes``; see docs/docker-provider.md.

    Each container runs ``spec.image`` with no capabilities, ``no-new-privileges``, a read-only
    root filesystem, no network (``network="none"``) unless asked, a non-root user (the image's
    own ``USER``, else uid 65534), bounded memory, processes and CPU, and two bounded tmpfs
    directories, the work directory (``disk_gib``) and ``/tmp`` (``tmp_mib``), the only places it
    can write. Its main process is ``spec.entrypoint`` or a keep-alive shell loop, under Docker's
    init. ``spec.env`` travels in the API request body, never on a command line. Commands run
    ``/bin/sh -c`` (the image needs a ``/bin/sh``); output keeps at most ``max_output_bytes`` per
    stream (head and tail); a timeout kills the command's processes in the container. Transfers go
    through the archive API, regular files only, at most ``max_transfer_bytes``. ``spec.ttl_s``
    becomes a deadline label that a watchdog process enforces (``_ttl.py``), whatever the entrypoint
    and whether or not this process lives. ``spec.metadata`` becomes labels: ``list`` and ``reap``
    find the sandboxes of any process. Images are never pulled unless ``pull=True``.
    """

    name = "docker"

    BOUNDS: ClassVar[Bounds] = Bounds(
        "DockerProvider",
        **LIMIT_BOUNDS,
        tmp_mib=POSITIVE.at_most(2**24).or_none(),
        max_output_bytes=Bound(0, strict=True, whole=True, high=2**53),
        max_transfer_bytes=Bound(0, strict=True, whole=True, high=2**53),
        request_timeout_s=POSITIVE.at_most(86400),
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
        self._user = check_text(user, "user")
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
        self._enforceable = {
            "memory_mib": bool(info.get("MemoryLimit")) and bool(info.get("SwapLimit", True)),
            "pids": bool(info.get("PidsLimit")),
            "cpu": bool(info.get("CpuCfsQuota")),
        }
        try:
            self._watchdog = WatchdogLauncher(self._socket, version)
        except PermissionError as exc:  # its lock's directory was made by someone else (_ttl.lock_path)
            raise SandboxError(f"DockerProvider: the TTL watchdog cannot lock safely: {exc}") from None
        self._api = EngineAPI(self._socket, version, request_timeout_s)  # last: nothing can fail after it
        self._commands = Commands(self._api, max_output_bytes, self._daemon)
        self._key = connect_key if connect_key is not None else os.urandom(32)
        self._boxes: dict[str, Box] = {}
        self._users: dict[str, tuple[str, tuple[int, int] | None]] = {}

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
            "disk": "tmpfs size of the work directory (the root filesystem is read-only)",
            "ttl": "deadline label, removed by the watchdog process",
            "output": f"exec stream, {self._max_output} bytes kept per stream",
        }

    # --- lifecycle -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        plan = await self._plan(spec)
        body = self._daemon.adapt(create_body(plan))
        name = f"sandbox-{uuid.uuid4().hex[:12]}"
        if plan.deadline is not None:  # before the container exists: a worker killed from here leaves none unwatched
            self._watchdog.ensure()
        container = await self._create_container(name, body, plan.image)
        try:
            await self._api.call("POST", f"/containers/{container}/start", f"start container {name}")
            # After start: a tmpfs volume written to before would be unmounted again, and its files lost.
            files = [(PurePosixPath(target), text.encode()) for target, text in spec.files.items()]
            await self._seed(container, plan, files)
        except BaseException as exc:
            left = f"; container {container[:12]} was not removed (its labels let reap find it)"
            # A removal that fails too (the daemon died) must not replace the start's error.
            with anyio.CancelScope(shield=True), anyio.move_on_after(30), contextlib.suppress(SandboxError):
                await self._remove(container)
                left = ""
            if isinstance(exc, EngineError | DockerUnavailableError):
                raise SandboxCreateError(
                    f"DockerProvider: cannot start a container of {plan.image!r}: {exc}{left}"
                ) from exc
            raise
        box = Box(
            container,
            plan.user,
            plan.cwd,
            (plan.mount, PurePosixPath("/tmp")),
            plan.ports,
            plan.deadline,
            plan.metadata,
            time.time(),
        )
        self._boxes[container] = box
        if plan.deadline is not None:
            self._watchdog.ensure()
        return SandboxHandle(container, self.name, {"container": container, "name": name})

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
        user, owner = await self._user_of(image)
        env = {"HOME": str(mount), **env}
        return Plan(
            image=image,
            user=user,
            owner=owner,
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
        )

    async def check_image(self, image: str) -> None:
        """Raise ``SandboxImageNotFoundError`` unless ``image`` is on the daemon (pulled first with
        ``pull=True``), as a create of it would: asked once before many creates (``sandbox-middleware run``)."""
        await self._user_of(check_text(image, "image").removeprefix("docker://"))

    async def _user_of(self, image: str) -> tuple[str, tuple[int, int] | None]:
        """Who commands run as (``user="auto"``: the image's non-root USER, else uid 65534), and its
        numeric uid and gid where known. Asking also says whether the image is there (and pulls it
        with ``pull=True``); the answer is kept per image."""
        known = self._users.get(image)
        if known is not None:
            return known
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
        if self._user != "auto":
            chosen = self._user, _numeric(self._user)
        else:
            configured = str((reply.json().get("Config") or {}).get("User") or "")
            chosen = (configured, _numeric(configured)) if configured not in _ROOT_USERS else (_NOBODY, (65534, 65534))
        self._users[image] = chosen
        return chosen

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

    async def _create_container(self, name: str, body: dict[str, Any], image: str) -> str:
        what = f"create a container of {image!r}"
        try:
            reply = await self._api.call("POST", "/containers/create", what, params={"name": name}, body=body)
        except DockerUnavailableError as exc:  # its response may be lost: the labels let reap find it
            raise SandboxCreateError(f"DockerProvider: {exc}") from exc
        except EngineError as exc:
            if exc.status == 404:
                self._users.pop(image, None)
                raise SandboxImageNotFoundError(
                    f"DockerProvider: image {image!r} is not on the daemon at {self._socket} (removed since it was "
                    "inspected?); build or load it again"
                ) from exc
            if exc.status == 400:
                raise SandboxArgumentError(f"DockerProvider: the daemon refused the container: {exc.message}") from exc
            raise SandboxCreateError(f"DockerProvider: cannot {what}: {exc.message}") from exc
        return str(reply.json()["Id"])

    async def _seed(self, container: str, plan: Plan, files: list[tuple[PurePosixPath, bytes]]) -> None:
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
                chunks += tar_records(parts, plan.owner or (0, 0), None if contents is None else len(contents))
                chunks += [] if contents is None else [contents, padding(len(contents))]
            if chunks:
                await self._api.call(
                    "PUT",
                    f"/containers/{container}/archive",
                    f"write spec.files to {mount}",
                    params={"path": str(mount), "noOverwriteDirNonDir": "true"},
                    content=b"".join(chunks) + END,
                )

    async def _remove(self, container: str) -> None:
        """Force-remove ``container`` and its volumes; one already gone, or being removed by another
        process (the TTL watchdog, a reaper, a second close), is done."""
        what = f"remove container {container[:12]}"
        reply = await self._api.call(
            "DELETE", f"/containers/{container}", what, params={"force": "true", "v": "true"}, ok=(404, 409)
        )
        if reply.status_code == 409 and "already in progress" not in (message := message_of(reply)):
            raise EngineError(409, message, what)

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
            sandbox_id = str(info["Id"])
        else:
            box.closed = True  # a command running now returns error_type="closed"
        try:
            await self._remove(sandbox_id)
        except BaseException:
            if box is not None:  # not removed: status asks the daemon again, and close can be retried
                box.closed = False
            raise
        self._boxes.pop(sandbox_id, None)

    async def aclose(self) -> None:
        """Close every sandbox still open here, then the connection pool; one error names those that failed."""
        failures = []
        try:
            for sandbox_id in list(self._boxes):
                try:
                    await self.close(SandboxHandle(sandbox_id, self.name))
                except SandboxError as exc:
                    failures.append(str(exc))
        finally:  # cancelled or not: the connection pool is released
            self._watchdog.reap()
            with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_TIMEOUT_S):
                await self._api.aclose()
        if failures:
            raise SandboxError(f"DockerProvider.aclose: {len(failures)} sandboxes not removed: {'; '.join(failures)}")

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
        call_env, timeout = checked_exec(command, env, timeout_s)
        box = self._box(handle)
        workdir = box.cwd if cwd is None else box.cwd / check_text(cwd, "cwd")
        as_user = box.user if user is None else _exec_user(user)
        deadline = exec_deadline(timeout, box.remaining())
        return await self._commands.run(handle, box, command, call_env, workdir, as_user, deadline)

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
            owner = _numeric(box.user) or (0, 0)
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
        box = box_of(sandbox_id, _labels(info), None) if info is not None else None
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
            box = box_of(str(container.get("Id")), container.get("Labels") or {}, container.get("Created"))
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


def _labels(info: Mapping[str, Any]) -> Mapping[str, str]:
    """A container's labels from its ``GET /containers/{id}/json``."""
    return (info.get("Config") or {}).get("Labels") or {}


def _restore(options: dict[str, Any]) -> DockerProvider:
    return DockerProvider(**options)


def _numeric(user: str) -> tuple[int, int] | None:
    """``"uid"`` or ``"uid:gid"`` as numbers; None for a user name (resolved inside the container)."""
    uid, _, gid = user.partition(":")
    if uid.isdigit() and (not gid or gid.isdigit()):
        return int(uid), int(gid or uid)
    return None


def _exec_user(user: str | int) -> str:
    if isinstance(user, bool) or not isinstance(user, str | int):
        raise SandboxArgumentError(f"user must be a name or a uid, not {user!r:.80}")
    if user in ("root", 0):
        return "0"
    return check_text(str(user), "user")
