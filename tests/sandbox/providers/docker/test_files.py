"""DockerProvider's work directories on the host (``_files.py``), on the real daemon under runc as root: a
snapshot of the work directory is made without a copy and forks are overlays on it; a process holding the
work directory makes it a copy; the directories go with their containers (close, a removal behind the
provider's back, the TTL watchdog); snapshots without a copy are listed, used by a second provider,
deleted (their mounts gone) and refused when hostile."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    DockerProvider,
    SandboxArgumentError,
    SandboxHandle,
    SandboxSnapshot,
    SandboxSnapshotNotFoundError,
)
from sandbox_middleware.providers.docker import _files
from sandbox_middleware.providers.docker._files import ROOT
from sandbox_middleware.providers.docker._ttl import FILES
from sandbox_middleware.providers.local._mounts import mounts_under

from ._daemon import private_daemon
from ._support import PYTHON, SESSION, SESSION_KEY, SOCKET, TAG, cannot_hold, engine, images, on_daemon, tagged

pytestmark = pytest.mark.anyio


@pytest.fixture
def tag() -> str:
    cannot_hold("podman", "the work directory is a tmpfs volume there (_files.usable)")
    cannot_hold("runsc", "gVisor's Gofer sees no mount made on the work directory later (_files.usable)")
    if os.geteuid() != 0:
        pytest.skip("the work directories on the host need root beside the daemon (run the tests as root)")
    return uuid.uuid4().hex[:12]


def _meta(tag: str) -> dict[str, str]:
    return {SESSION_KEY: SESSION, TAG: tag}


def _directory(handle: SandboxHandle, socket: str = SOCKET) -> Path:
    """The work directory on the host of a sandbox (of the daemon at ``socket``), from its container's label."""
    with engine(socket) as client:
        labels = client.get(f"/containers/{handle.sandbox_id}/json").json()["Config"]["Labels"]
    found = list(ROOT.glob(f"*/{labels[FILES]}"))
    assert len(found) == 1
    return found[0]


async def _out(provider: DockerProvider, handle: SandboxHandle, command: str, **options: object) -> str:
    result = await provider.exec(handle, command, **options)  # type: ignore[arg-type]
    assert result.return_code == 0, result
    return result.stdout or ""


def _mounted(path: Path) -> list[Path]:
    return [point for point in mounts_under(path.parent) if point == path or point.is_relative_to(path)]


async def test_a_snapshot_is_made_without_a_copy_and_forks_are_overlays(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """The snapshot is a record on the host (no image), the parent goes on in an overlay of its frozen
    files, each fork's work directory is an overlay on the snapshot's layers, written to its own tmpfs
    of its own disk_gib; deleting the snapshot unmounts its layers and the forks run on."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "mkdir src && echo one > src/a && head -c 100000 /dev/zero > big")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    assert snapshot.snapshot_id.startswith("snap-") and snapshot.size_bytes == 4 + 100000
    assert images(f"sandbox_middleware.docker.meta.{TAG}={tag}") == []
    forks = [await provider.create(tagged(tag, resources={"disk_gib": 1}), from_snapshot=snapshot) for _ in "ab"]
    for box in (parent, *forks):
        assert " /workspace " in await _out(provider, box, "grep ' overlay ' /proc/self/mountinfo")
    assert await _out(provider, forks[0], "cat src/a; df -k . | tail -1 | awk '{print $2}'") == "one\n1048576\n"
    await _out(provider, forks[0], "echo fork > src/a")
    assert await _out(provider, forks[1], "cat src/a") == "one\n"
    assert await _out(provider, parent, "cat src/a") == "one\n"
    assert [item.snapshot_id for item in await provider.list_snapshots(metadata={TAG: tag})] == [snapshot.snapshot_id]
    kept = list(ROOT.glob(f"*/{snapshot.snapshot_id}-*"))
    assert len(kept) == 1 and _mounted(kept[0])
    await provider.delete_snapshot(snapshot)
    assert not kept[0].exists() and await provider.list_snapshots(metadata={TAG: tag}) == []
    assert await _out(provider, forks[1], "cat src/a") == "one\n"
    with pytest.raises(SandboxSnapshotNotFoundError):
        await provider.create(tagged(tag), from_snapshot=snapshot)
    directories = [_directory(box) for box in (parent, *forks)]
    for box in (parent, *forks):
        await provider.close(box)
    assert not any(directory.exists() for directory in directories) and on_daemon(tag) == []


async def test_a_process_holding_the_work_directory_makes_the_snapshot_a_copy(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """A process left in the work directory (its cwd), or mapping a file of it (its descriptor closed),
    could write into the files after a snapshot without a copy: the snapshot is then an image, and still
    right; once it is gone, the next one is made without a copy."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag, image=PYTHON))
    await _out(provider, parent, "echo one > a && (sleep 600 > /dev/null 2>&1 & echo $! > /tmp/pid)")
    held = await provider.snapshot(parent, metadata=_meta(tag))
    assert not held.snapshot_id.startswith("snap-")
    mapper = (
        "import mmap, os, time\n"
        "f = open('/workspace/m', 'w+b'); f.write(b'x' * 4096); f.flush()\n"
        "m = mmap.mmap(f.fileno(), 4096); f.close(); time.sleep(600)\n"
    )
    script = (
        f"kill $(cat /tmp/pid); cat > /tmp/map.py << 'EOF'\n{mapper}EOF\n"
        "(cd / && python3 /tmp/map.py > /dev/null 2>&1 & echo $! > /tmp/pid)"
    )
    await _out(provider, parent, script)
    await anyio.sleep(1)
    mapped = await provider.snapshot(parent, metadata=_meta(tag))
    assert not mapped.snapshot_id.startswith("snap-")
    await _out(provider, parent, "kill $(cat /tmp/pid); sleep 0.3")
    free = await provider.snapshot(parent, metadata=_meta(tag))
    assert free.snapshot_id.startswith("snap-")
    for snapshot, files in ((held, "one\n"), (mapped, "one\nm\n"), (free, "one\nm\n")):
        fork = await provider.create(tagged(tag, image=PYTHON), from_snapshot=snapshot)
        assert await _out(provider, fork, "cat a; ls | grep -x m || true") == files
        await provider.close(fork)
        await provider.delete_snapshot(snapshot)
    await provider.close(parent)
    assert on_daemon(tag) == [] and images(f"sandbox_middleware.docker.meta.{TAG}={tag}") == []


_HOLDER = """
import array, os, socket, time
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
os.chdir("/")
fd = os.open("/workspace", os.O_RDONLY | os.O_DIRECTORY)
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
os.close(fd)
open("/tmp/ready", "w").close()
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
_, ancillary, _, _ = b.recvmsg(1, socket.CMSG_LEN(4))
fd = array.array("i", ancillary[0][2][:4])[0]
with open(os.open("state", os.O_WRONLY | os.O_TRUNC, dir_fd=fd), "w") as state:
    state.write("poisoned\\n")
open("/tmp/done", "w").close()
"""


async def test_a_process_left_running_makes_the_snapshot_a_copy_whatever_it_holds(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """A process besides the sandbox's own can hold the work directory where no /proc listing shows it (here
    a descriptor in a socket's queue, its cwd elsewhere): the snapshot is then a copy, and what it writes
    through that descriptor after the snapshot reaches no fork."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag, image=PYTHON))
    await _out(provider, parent, "echo prepared > state")
    started = "cd / && (python3 /tmp/holder.py > /dev/null 2>&1 &); while [ ! -e /tmp/ready ]; do sleep 0.05; done"
    await _out(provider, parent, f"cat > /tmp/holder.py << 'EOF'\n{_HOLDER}EOF\n{started}")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    assert not snapshot.snapshot_id.startswith("snap-")
    written = "touch /tmp/go; while [ ! -e /tmp/done ]; do sleep 0.05; done; cat state"
    assert await _out(provider, parent, written) == "poisoned\n"
    fork = await provider.create(tagged(tag, image=PYTHON), from_snapshot=snapshot)
    assert await _out(provider, fork, "cat state") == "prepared\n"
    await provider.delete_snapshot(snapshot)
    for handle in (parent, fork):
        await provider.close(handle)


async def test_an_upload_waiting_for_a_snapshot_s_count_leaves_the_event_loop_running(
    make: Callable[..., DockerProvider], tag: str, tmp_path: Path
) -> None:
    """An upload into the work directory waits for its lock, held exclusive by a snapshot's count (up to
    a second for a large tree), in a worker thread: the loop runs on meanwhile, and the upload lands after."""
    provider = make(prestart=False)
    box = await provider.create(tagged(tag))
    source = tmp_path / "late"
    source.write_text("after the count")
    fd = os.open(_directory(box), os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a snapshot's count holds it
    released, releasing = threading.Event(), threading.Lock()

    def release() -> None:
        with releasing:
            if not released.is_set():
                released.set()
                os.close(fd)

    timer = threading.Timer(60, release)  # an upload blocking the loop never lets the test release it
    timer.start()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(provider.upload_file, box, source, "late")
            await anyio.sleep(0.5)  # returns before the timer's release only if the upload waits off the loop
            assert not released.is_set()
            release()
    finally:
        timer.cancel()
        release()
    assert await _out(provider, box, "cat late") == "after the count"


async def test_work_directories_go_with_their_containers(
    make: Callable[..., DockerProvider], tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed by close; by the next provider's sweep when the container was removed behind the provider's
    back (once older than a minute: a create may be making it); by the TTL watchdog with its container."""
    provider = make(prestart=False)
    closed, removed, expiring = [await provider.create(tagged(tag, ttl_s=ttl)) for ttl in (None, None, 2)]
    directories = [_directory(box) for box in (closed, removed, expiring)]
    assert all(directory.is_dir() and _mounted(directory) for directory in directories)
    await provider.close(closed)
    assert not directories[0].exists()
    with engine() as client:
        client.delete(f"/containers/{removed.sandbox_id}", params={"force": "1"})
    for _ in range(200):  # the watchdog's poll
        if not directories[2].exists():
            break
        await anyio.sleep(0.1)
    assert not directories[2].exists() and not _mounted(directories[2])
    make(prestart=False)  # a new provider sweeps what no container names (and no create holds)
    assert not directories[1].exists() and not _mounted(directories[1])
    lock = directories[1].parent / f"{directories[1].name}.lock"
    assert not lock.exists()
    lock.touch()  # a create's, about to make its directory: left to it for a minute
    make(prestart=False)
    assert lock.exists()
    monkeypatch.setattr(_files, "_YOUNG_S", 0.0)
    make(prestart=False)
    assert not lock.exists()
    assert on_daemon(tag) == []


async def test_another_daemon_of_the_host_keeps_off_this_ones_work_directories(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """Two daemons of one host can answer one ID (Docker 20.10's is /etc/docker/key.json's, which a second
    dockerd reads too): a provider of the other one sweeps at construction and at aclose, and removes none
    of this daemon's work directories, whose containers it does not see; nor does it find this one's
    snapshots; its own sandboxes' work directories are elsewhere."""
    provider = make(prestart=False)
    box = await provider.create(tagged(tag))
    await _out(provider, box, "echo kept > a")
    snapshot = await provider.snapshot(box, metadata=_meta(tag))
    await _out(provider, box, "echo after > b")  # in the overlay mounted on the work directory since
    with private_daemon() as daemon:
        other = DockerProvider(socket=daemon.socket, prestart=False)
        try:
            theirs = await other.create(tagged(tag))
            assert _directory(theirs, daemon.socket).parent != _directory(box).parent
            with pytest.raises(SandboxSnapshotNotFoundError):
                await other.create(tagged(tag), from_snapshot=snapshot)
            await other.close(theirs)
        finally:
            await other.aclose()
    assert await _out(provider, box, "cat a b") == "kept\nafter\n"
    fork = await provider.create(tagged(tag), from_snapshot=snapshot)
    assert await _out(provider, fork, "cat a") == "kept\n"
    await provider.delete_snapshot(snapshot)
    for handle in (box, fork):
        await provider.close(handle)


async def test_hostile_snapshot_descriptors_are_not_found_and_nothing_is_removed(
    make: Callable[..., DockerProvider], tag: str
) -> None:
    """A changed descriptor, another provider's, an id with a path in it, one never taken: typed errors for
    create and delete, the snapshot still there; a second provider (unpickled) forks from it."""
    provider = make(prestart=False)
    parent = await provider.create(tagged(tag))
    await _out(provider, parent, "echo one > a")
    snapshot = await provider.snapshot(parent, metadata=_meta(tag))
    changed = snapshot.to_dict()
    hostile = [
        SandboxSnapshot.from_dict({**changed, "metadata": {}}),
        SandboxSnapshot.from_dict({**changed, "size_bytes": snapshot.size_bytes + 1}),
        SandboxSnapshot.from_dict({**changed, "provider": "local"}),
        *(
            SandboxSnapshot.from_dict({**changed, "snapshot_id": bad})
            for bad in ("snap-0000000000000", "snap-../../../etc", f"{snapshot.snapshot_id}/..", "box-0")
        ),
    ]
    for descriptor in hostile:
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.create(tagged(tag), from_snapshot=descriptor)
        with pytest.raises(SandboxSnapshotNotFoundError):
            await provider.delete_snapshot(descriptor)
    with pytest.raises(SandboxArgumentError):
        await provider.create(tagged(tag), from_snapshot=json.loads(json.dumps(changed)))  # type: ignore[arg-type]
    other = pickle.loads(pickle.dumps(provider))
    fork = await other.create(tagged(tag), from_snapshot=SandboxSnapshot.from_dict(json.loads(json.dumps(changed))))
    assert await _out(other, fork, "cat a") == "one\n"
    await other.close(fork)
    await other.aclose()
    await provider.delete_snapshot(snapshot)
    await provider.close(parent)
    assert on_daemon(tag) == []
