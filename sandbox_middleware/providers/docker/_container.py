"""One DockerProvider sandbox: the container's create body (hardened), and its labels, read back as a ``Box``.

Everything another process needs to use, list, connect to or reap a sandbox is in the container's
labels (``LABEL`` marks it as ours): the user commands run as, the host uid leased for it
(``UID``: ``_identity.py``), the work directory, the writable mounts, the declared ports, the
deadline of its TTL (``_ttl.EXPIRES``) and ``spec.metadata``
(``META`` + key). Labels are set at create and cannot be changed from inside the container. A spare
(``_spares.py``) is told by its ``_ttl.SPARE`` label; once taken, its name says when, and its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from ..._errors import SandboxArgumentError
from .._common._arguments import check_text, checked_texts, checked_view_root
from .._common._limits import Limits
from ._pools import pts_mount, ulimits
from ._ttl import EXPIRES, FILES, deadline_of, taken_at

__all__ = [
    "LABEL",
    "META",
    "UID",
    "BodyOf",
    "Box",
    "HostDir",
    "Made",
    "Plan",
    "box_of",
    "checked_metadata",
    "create_body",
    "keepalive_default",
    "label_keys",
    "leased_uid",
    "metadata_filters",
    "workdir_of",
]

LABEL = "sandbox_middleware.docker"
META = "sandbox_middleware.docker.meta."
_USER = "sandbox_middleware.docker.user"
UID = "sandbox_middleware.docker.uid"  # set where the uid is leased: close and reap release it
_WORKDIR = "sandbox_middleware.docker.workdir"
_MOUNTS = "sandbox_middleware.docker.mounts"
_PORTS = "sandbox_middleware.docker.ports"
TMP = PurePosixPath("/tmp")
DEFAULT_MOUNT = PurePosixPath("/workspace")
SHM_BYTES = 16 << 20


@dataclass
class Box:
    """What a provider keeps of one container it holds (or found by its labels)."""

    container: str  # the full container id
    user: str  # what commands run as: "uid:gid"
    cwd: PurePosixPath  # the default cwd of commands (in the work directory)
    mounts: tuple[PurePosixPath, ...]  # the writable directories: the work directory's mount, /tmp
    ports: tuple[int, ...]
    deadline: float | None  # time.time() at which its TTL runs out
    metadata: dict[str, str]
    created: float | None = None
    closed: bool = False
    paused: bool = False  # by this provider's pause(), until its resume()
    uid: int | None = None  # the host uid leased for it (None: the provider's fixed user=)
    files: str | None = None  # the key of its work directory's tmpfs on the host (``_files.py``; None: a volume)

    def is_expired(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.time())


@dataclass(frozen=True)
class Plan:
    """What ``create`` decided from the spec and the provider's options."""

    image: str
    mount: PurePosixPath  # where the bounded work directory is mounted
    cwd: PurePosixPath
    env: dict[str, str]
    entrypoint: list[str] | None
    keepalive: list[str]
    limits: Limits
    tmp_bytes: int | None
    network: str
    ports: tuple[int, ...]
    deadline: float | None
    metadata: dict[str, str]
    init: bool
    nofile: int  # RLIMIT_NOFILE per process
    nproc: int | None  # RLIMIT_NPROC of its uid (None: not set; a uid shared by sandboxes)
    ptys: int  # pseudo-terminals at most (0: no devpts)
    tcp_bytes: int | None  # its TCP buffers at most (cgroup v1, written from the host after start)
    remapped: bool = False  # the daemon maps container uids to others on the host (userns-remap, rootless)
    host_files: bool = False  # the work directory is a tmpfs this process mounts on the host (``_files.py``)


BodyOf = Callable[[tuple[int, int], bool, "HostDir | None"], dict[str, Any]]
"""A container's create body for its host uid and gid, whether that uid is leased (its own), and its work
directory on the host (``plan.host_files``): ``create_body`` of a plan, or ``_spares.spare_body``."""


@dataclass(frozen=True)
class HostDir:
    """A work directory on the host (``_files.py``): its key (the ``FILES`` label) and the path bound."""

    key: str
    path: str


@dataclass(frozen=True)
class Made:
    """A container made (created and started) for a sandbox or a spare: its id, the name it was created
    with (or renamed to when taken), its host uid and gid, and the uid leased for it (None: the
    provider's fixed ``user=``), claimed for its id."""

    container: str
    name: str
    owner: tuple[int, int]
    uid: int | None
    files: str | None = None  # its work directory's key on the host (``_files.py``)


def workdir_of(workdir: str | None) -> tuple[PurePosixPath, PurePosixPath]:
    """The work directory's mount point and the default cwd for ``spec.workdir`` (relative: below /workspace)."""
    if workdir is None:
        return DEFAULT_MOUNT, DEFAULT_MOUNT
    check_text(workdir, "spec.workdir")
    if PurePosixPath(workdir).is_absolute():
        view = checked_view_root(workdir)
        return view, view
    cwd = DEFAULT_MOUNT.joinpath(workdir)
    if ".." in cwd.parts:
        raise SandboxArgumentError(f"spec.workdir {workdir!r} uses '..'; name a directory below the work directory")
    return DEFAULT_MOUNT, cwd


def _tmpfs(target: PurePosixPath, size: int | None, owner: tuple[int, int] | None) -> dict[str, Any]:
    """An anonymous volume on a tmpfs of ``size`` bytes: unlike a plain tmpfs mount, the archive API sees it.
    Owned by ``owner``, host uid and gid; None (a remapping daemon: the host uid is not known): mode 1777."""
    options = ["nosuid", "nodev"]
    if size is not None:
        options.append(f"size={size}")
    options += [f"uid={owner[0]}", f"gid={owner[1]}", "mode=0700"] if owner else ["mode=1777"]
    return {
        "Type": "volume",
        "Target": str(target),
        "VolumeOptions": {
            "Labels": {LABEL: "1"},
            "DriverConfig": {"Name": "local", "Options": {"type": "tmpfs", "device": "tmpfs", "o": ",".join(options)}},
        },
    }


def _bound(target: PurePosixPath, files: HostDir | None) -> dict[str, Any]:
    """The work directory on the host (``_files.py``; None: its place in a spare's shape) bound in as a
    slave: what is mounted on it later shows in the container."""
    return {
        "Type": "bind",
        "Source": "" if files is None else files.path,
        "Target": str(target),
        "BindOptions": {"Propagation": "rslave"},
    }


def create_body(plan: Plan, owner: tuple[int, int], leased: bool, files: HostDir | None = None) -> dict[str, Any]:
    """The body of ``POST /containers/create``: run as the host uid and gid ``owner`` (``leased``: the
    sandbox's own), no capabilities, no new privileges, a read-only root, bounded writable directories
    (the work directory ``files`` where ``plan.host_files``), the limits, the host's kernel pools bounded
    (``_pools.py``), the network asked for (``none`` by default), ports published on 127.0.0.1 only, and
    the labels."""
    limits = plan.limits
    user = f"{owner[0]}:{owner[1]}"
    files_owner = None if plan.remapped else owner
    host: dict[str, Any] = {
        "NetworkMode": plan.network,
        "Init": plan.init,
        "Mounts": [
            _bound(plan.mount, files) if plan.host_files else _tmpfs(plan.mount, limits.disk_bytes, files_owner),
            _tmpfs(TMP, plan.tmp_bytes, files_owner),
            pts_mount(plan.ptys),
        ],
        "Ulimits": ulimits(plan.nofile, plan.nproc),
        "PortBindings": {f"{port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}] for port in plan.ports},
        "Memory": limits.memory_bytes or 0,
        "MemorySwap": limits.memory_bytes or 0,  # equal to Memory: no swap beyond the limit
        "NanoCpus": int(limits.cpu * 1e9) if limits.cpu is not None else 0,
        "PidsLimit": limits.pids or 0,
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges"],
        "ReadonlyRootfs": True,
        # The provider never reads container logs: with a log driver, output of the main process (or
        # a command writing to /proc/1/fd/1) would grow a file on the host's disk without bound.
        "LogConfig": {"Type": "none", "Config": {}},
        "ShmSize": SHM_BYTES,  # /dev/shm: a tmpfs charged to the memory cgroup
    }
    mounts = ",".join(str(mount) for mount in (plan.mount, TMP))
    labels = {
        LABEL: "1",
        _USER: user,
        _WORKDIR: str(plan.cwd),
        _MOUNTS: mounts,
        _PORTS: ",".join(map(str, plan.ports)),
        **{META + key: value for key, value in plan.metadata.items()},
    }
    if leased:
        labels[UID] = str(owner[0])
    if files is not None:
        labels[FILES] = files.key
    if plan.deadline is not None:
        labels[EXPIRES] = repr(plan.deadline)
    command = plan.entrypoint or plan.keepalive
    return {
        "Image": plan.image,
        "User": user,
        # Not below it (the daemon would make a missing cwd as root's); the keep-alive's is "/": no idle
        # process holds the work directory, which a snapshot without a copy needs (``_files.py``).
        "WorkingDir": str(plan.mount) if plan.entrypoint else "/",
        "Env": [f"{name}={value}" for name, value in plan.env.items()],
        "Entrypoint": command[:1],
        "Cmd": command[1:],
        "Labels": labels,
        "ExposedPorts": {f"{port}/tcp": {} for port in plan.ports},
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "Tty": False,
        "HostConfig": host,
    }


def box_of(container: str, labels: Mapping[str, str], created: float | None, name: str) -> Box | None:
    """The sandbox a container's labels (and, for a taken spare, its name) describe; None for a container
    that is not one of ours. A taken spare was created when it was taken."""
    if labels.get(LABEL) != "1":
        return None
    taken = taken_at(name)
    if taken is not None:
        created = taken[0]
    try:
        deadline = deadline_of(labels, name)
        ports = tuple(int(port) for port in labels.get(_PORTS, "").split(",") if port)
        mounts = tuple(PurePosixPath(mount) for mount in labels[_MOUNTS].split(","))
        cwd = PurePosixPath(labels[_WORKDIR])
        user = labels[_USER]
        uid = leased_uid(labels)
        files = labels.get(FILES)
    except (KeyError, ValueError):
        return None
    if not cwd.is_absolute() or not all(mount.is_absolute() for mount in mounts):
        return None
    metadata = {key[len(META) :]: value for key, value in labels.items() if key.startswith(META)}
    return Box(container, user, cwd, mounts, ports, deadline, metadata, created, uid=uid, files=files)


def leased_uid(labels: Mapping[str, str]) -> int | None:
    """The host uid leased for a container, from its labels (None: none was)."""
    text = labels.get(UID, "")
    return int(text) if text.isascii() and text.isdigit() else None


def metadata_filters(metadata: Mapping[str, str]) -> list[str]:
    """``label`` filters of ``GET /containers/json`` for containers of ours whose metadata has all of ``metadata``."""
    return [f"{LABEL}=1", *(f"{META}{key}={value}" for key, value in metadata.items())]


def checked_metadata(metadata: object, what: str) -> dict[str, str]:
    """Metadata fit for labels: strings (``checked_texts``), keys as ``label_keys`` checks them."""
    return label_keys(checked_texts(metadata, what), what)


def label_keys(metadata: dict[str, str], what: str) -> dict[str, str]:
    """``metadata`` (strings) if its keys are fit for labels: non-empty, without '=' (a label filter splits there)."""
    for key in metadata:
        if not key or "=" in key:
            raise SandboxArgumentError(f"{what} key {key!r:.80} must be non-empty and without '=' (labels)")
    return metadata


def keepalive_default() -> Sequence[str]:
    return ("/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done")
