"""The parsers of DockerProvider that need no daemon: the exec stream's frames, the pid line, paths, stat headers."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import random
import re
import shutil
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath

import pytest

from sandbox_middleware import SandboxError, SandboxPathError, SandboxTransferLimitError
from sandbox_middleware.providers._common._limits import Limits
from sandbox_middleware.providers.docker._archive import TarReader, check_stat, located, owned_stream
from sandbox_middleware.providers.docker._container import UID, Plan, create_body
from sandbox_middleware.providers.docker._daemons import Daemon
from sandbox_middleware.providers.docker._exec import PidReader
from sandbox_middleware.providers.docker._spares import shape_of, spare_body
from sandbox_middleware.providers.docker._streams import Demultiplexer, OutputCapture
from sandbox_middleware.providers.docker._ttl import SPARE, SPARE_UNTIL
from tests.needs import unavailable

from ._support import INSTALL, REQUIRE, build_failure


def _frame(stream: int, data: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


@pytest.mark.parametrize("seed", range(5))
def test_frames_split_anywhere_come_back_whole(seed: int) -> None:
    rng = random.Random(seed)
    parts = [(rng.choice([1, 2]), rng.randbytes(rng.randrange(0, 300))) for _ in range(50)]
    body = b"".join(_frame(stream, data) for stream, data in parts) + _frame(0, b"stdin is dropped")
    out, err = OutputCapture(1 << 20), OutputCapture(1 << 20)
    demux = Demultiplexer(out, err)
    at = 0
    while at < len(body):
        step = rng.randrange(1, 40)
        demux.feed(body[at : at + step])
        at += step
    want = {s: b"".join(d for stream, d in parts if stream == s) for s in (1, 2)}
    assert out.text() == want[1].decode("utf-8", "replace") and err.text() == want[2].decode("utf-8", "replace")


def test_a_flood_is_bounded_head_and_tail() -> None:
    out = OutputCapture(100)
    demux = Demultiplexer(out, OutputCapture(100))
    demux.feed(_frame(1, b"H" * 60 + b"x" * 10_000 + b"T" * 60))
    assert out.text().startswith("H" * 50) and out.text().endswith("T" * 50) and out.dropped == 10_020


def test_the_pid_line_is_taken_off_stderr() -> None:
    err = OutputCapture(1000)
    reader = PidReader(err)
    for chunk in (b"12", b"3\nreal ", b"stderr"):
        reader.feed(chunk)
    assert reader.pid == 123 and err.text() == "real stderr"
    other = OutputCapture(1000)
    PidReader(other).feed(b"not a pid\n")
    assert other.text() == "not a pid\n"


MOUNTS = (PurePosixPath("/workspace"), PurePosixPath("/tmp"))


@pytest.mark.parametrize(
    ("path", "mount", "parts"),
    [("a/b", "/workspace", ("work", "a", "b")), ("/tmp/x", "/tmp", ("x",)), ("/workspace/y", "/workspace", ("y",))],
)
def test_paths_land_in_a_writable_directory(path: str, mount: str, parts: tuple[str, ...]) -> None:
    assert located(path, PurePosixPath("/workspace/work"), MOUNTS, "p") == (PurePosixPath(mount), parts)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "/tmpx/y", "a/../../b", "bad\0name"])
def test_paths_elsewhere_are_refused(path: str) -> None:
    with pytest.raises(SandboxError):
        located(path, PurePosixPath("/workspace"), MOUNTS, "p")


def _stat(mode: int, size: int = 1) -> str:
    return base64.b64encode(json.dumps({"name": "f", "size": size, "mode": mode}).encode()).decode()


def test_only_regular_files_within_the_limit_pass() -> None:
    check_stat(_stat(0o644, 10), "f", 10)
    with pytest.raises(SandboxPathError, match="symlink"):
        check_stat(_stat(1 << 27 | 0o777), "f", 10)
    for special in (1 << 31, 1 << 25, 1 << 24, 1 << 26 | 1 << 21):
        with pytest.raises(SandboxError, match="not a file"):
            check_stat(_stat(special | 0o644), "f", 10)
    with pytest.raises(SandboxTransferLimitError):
        check_stat(_stat(0o644, 11), "f", 10)
    with pytest.raises(SandboxError, match="did not say"):
        check_stat(None, "f", 10)


def test_the_watchdog_lock_is_in_a_directory_of_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another local user who made the lock's directory first (or planted a symlink as the lock)
    gets no hold on the watchdog: the directory is refused, the symlink never followed."""
    from sandbox_middleware.providers.docker import _ttl

    monkeypatch.setattr(_ttl.os, "geteuid", lambda: os.getuid() + 4242)  # not root
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(_ttl.tempfile, "gettempdir", lambda: str(tmp_path))
    planted = Path(tmp_path) / f"sandbox_middleware-{os.getuid() + 4242}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    with pytest.raises(PermissionError, match="mode 0700"):
        _ttl.lock_path("/var/run/docker.sock")
    planted.rmdir()
    monkeypatch.setattr(_ttl.os, "geteuid", os.getuid)
    lock = Path(_ttl.lock_path("/var/run/docker.sock")) if os.getuid() else None
    if lock is not None:  # root's directory is /run/sandbox_middleware
        assert lock.parent == planted.with_name(f"sandbox_middleware-{os.getuid()}")
        assert stat.S_IMODE(lock.parent.stat().st_mode) == 0o700
    link = Path(tmp_path) / "link.lock"
    target = Path(tmp_path) / "target"
    target.write_text("x")
    link.symlink_to(target)
    assert not _ttl._running(str(link))
    with pytest.raises(OSError):
        _ttl._open_lock(str(link))
    assert target.read_text() == "x"


def test_roots_watchdog_lock_is_in_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox_middleware.providers.docker import _ttl

    if os.geteuid() != 0:
        pytest.skip("needs root (the lock's directory of root is /run/sandbox_middleware)")
    lock = Path(_ttl.lock_path("/var/run/docker.sock"))
    assert lock.parent == Path("/run/sandbox_middleware")
    info = lock.parent.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o700


def test_a_spares_state_is_read_from_its_labels_and_name() -> None:
    """Untaken, a spare is due at its SPARE_UNTIL and is a spare whatever else its name says; taken, its
    name says when and its deadline (none without a TTL); a container without SPARE keeps EXPIRES."""
    from sandbox_middleware.providers.docker._ttl import (
        EXPIRES,
        SPARE,
        SPARE_UNTIL,
        deadline_of,
        is_spare,
        taken_at,
        taken_name,
    )

    spare = {SPARE: "{}", SPARE_UNTIL: "1000.5", EXPIRES: "1"}
    for untaken in ("/sandbox-0123456789ab-spare", "/renamed", "/sandbox-0123456789ab-at-x", ""):
        assert is_spare(spare, untaken) and deadline_of(spare, untaken) == 1000.5
    name = taken_name("sandbox-0123456789ab", 2000.25, 2600.75)
    assert name == "sandbox-0123456789ab-at-2000250-until-2600750"
    assert taken_at("/" + name) == (2000.25, 2600.75) and not is_spare(spare, "/" + name)
    assert deadline_of(spare, "/" + name) == 2600.75  # not EXPIRES, which only a spare's own labels could hold
    assert deadline_of(spare, taken_name("sandbox-0123456789ab", 2000.0, None)) is None
    assert deadline_of({EXPIRES: "42"}, "/" + name) == 42.0 and deadline_of({}, "/any") is None
    assert not is_spare({EXPIRES: "42"}, "/sandbox-0123456789ab-spare")
    with pytest.raises(ValueError):
        deadline_of({SPARE: "{}", SPARE_UNTIL: "soon"}, "/x")


def _tar_of(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def _chunks(data: bytes, size: int = 700) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.anyio
async def test_a_download_target_that_is_not_a_regular_file_is_refused_and_kept(tmp_path: Path) -> None:
    """A target that is a link to a device, a directory or a FIFO is refused with a SandboxError
    naming it; nothing there is written, truncated or removed (the link to /dev/null was deleted)."""
    archive = _tar_of("f", b"payload" * 300)
    device = tmp_path / "null"
    device.symlink_to("/dev/null")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (device, tmp_path, fifo):
        with pytest.raises(SandboxError, match=re.escape(str(target))):
            await TarReader("f", target, 1 << 20).read(_chunks(archive))
    assert device.is_symlink() and fifo.exists()
    kept = tmp_path / "kept"
    kept.write_bytes(b"old")
    await TarReader("f", kept, 1 << 20).read(_chunks(archive))
    assert kept.read_bytes() == b"payload" * 300


@pytest.mark.anyio
async def test_a_cut_archive_leaves_no_half_written_file(tmp_path: Path) -> None:
    archive = _tar_of("f", b"x" * 5000)
    target = tmp_path / "out"
    with pytest.raises(SandboxError, match="ended early"):
        await TarReader("f", target, 1 << 20).read(_chunks(archive[:2048]))
    assert not target.exists()


@pytest.mark.parametrize("network", ["host", "container:abc123"])
def test_a_shared_network_namespace_is_refused_before_the_daemon_is_asked(network: str) -> None:
    from sandbox_middleware import DockerProvider, SandboxArgumentError

    with pytest.raises(SandboxArgumentError, match=f"network='{network}' shares a network namespace"):
        DockerProvider(socket="/nonexistent/docker.sock", network=network)


def test_a_failing_image_build_says_what_the_script_said(tmp_path: Path) -> None:
    """scripts/build-docker-images.sh failing is its own error in the test's failure, not only
    `CalledProcessError ... exit status 1`: a busybox that cannot run, then a daemon that is not there
    (neither build reaches a daemon)."""
    if shutil.which("docker") is None or not os.path.exists("/bin/busybox"):
        unavailable(
            f"the script needs the docker CLI and busybox-static: {INSTALL}, apt-get install busybox-static", REQUIRE
        )
    not_busybox = tmp_path / "busybox"
    not_busybox.write_text("not a program\n")  # not executable
    nowhere = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock", "FORCE": "1"}
    failure = build_failure("busybox", env={**nowhere, "BUSYBOX": str(not_busybox)})
    assert failure is not None and failure.startswith("scripts/build-docker-images.sh failed (exit 126):"), failure
    assert f"{not_busybox}: Permission denied" in failure
    failure = build_failure("busybox", env=nowhere)
    assert failure is not None and failure.startswith("scripts/build-docker-images.sh failed (exit 1):"), failure
    assert f"Cannot connect to the Docker daemon at unix://{tmp_path}/no-daemon.sock" in failure


def _plan(**changes: object) -> Plan:
    """A plan as ``DockerProvider._plan`` makes one (default limits, a leased uid's RLIMIT_NPROC)."""
    limits = Limits.resolve({"memory_mib": 256, "pids": 64, "cpu": None, "disk_gib": 1}, None)
    plan = Plan(
        image="sandbox-middleware/busybox:test",
        mount=PurePosixPath("/workspace"),
        cwd=PurePosixPath("/workspace"),
        env={"HOME": "/workspace"},
        entrypoint=None,
        keepalive=["/bin/sh"],
        limits=limits,
        tmp_bytes=1 << 20,
        network="none",
        ports=(),
        deadline=None,
        metadata={},
        init=True,
        nofile=256,
        nproc=64,
        ptys=0,
        tcp_bytes=64 << 20,
    )
    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


def test_a_spares_shape_leaves_out_the_uid_and_deadline_but_not_the_host_pools_bounds() -> None:
    """A spare matches creates whatever uid each container is leased, and whatever their TTL's deadline;
    never one whose open files, processes, ptys or TCP buffers are bounded otherwise. Its body is the
    sandbox's for its own uid, with the spare's labels."""
    plan, adapt = _plan(), Daemon("docker", None, "runc").adapt
    shape = shape_of(plan, None, adapt)
    assert shape is not None and shape == shape_of(_plan(deadline=1e10), None, adapt)
    assert str(UID) in shape.key and '"User": "-1:-1"' in shape.key  # a leased uid, none in particular
    for other in (_plan(nofile=512), _plan(nproc=128), _plan(ptys=4), _plan(tcp_bytes=None), _plan(tcp_bytes=1 << 20)):
        assert shape_of(other, None, adapt) != shape
    fixed = shape_of(plan, (2000, 2000), adapt)
    assert fixed not in (shape, shape_of(plan, (2001, 2001), adapt))  # a fixed user= is its shape
    assert shape_of(_plan(entrypoint=["/bin/true"]), None, adapt) is None
    # the body as the daemon is given it: another runtime's, or Podman's mounts and ulimits, is another shape
    for daemon in (Daemon("docker", "runsc", "runc"), Daemon("podman", None, "runc")):
        assert shape_of(plan, None, daemon.adapt) != shape
    body, sandbox = spare_body(plan, 123.0, (7, 7), True), create_body(plan, (7, 7), True)
    assert {key: value for key, value in body["Labels"].items() if key not in (SPARE, SPARE_UNTIL)} == sandbox["Labels"]
    assert body["Labels"][UID] == "7" and body["Labels"][SPARE_UNTIL] == "123.0"
    assert {**body, "Labels": None} == {**sandbox, "Labels": None}  # User, ulimits, pty and tmpfs mounts: its own


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "message", "gone"),
    [
        (404, "No such container: c1", True),
        (500, "container c1 does not exist in database: no such container", True),  # Podman, mid-removal
        (500, "something else broke", False),
    ],
)
async def test_inspect_takes_podmans_no_such_container_as_gone(
    tmp_path: Path, status: int, message: str, gone: bool
) -> None:
    """A daemon's inspect answer: 404, or Podman's 500 'no such container' (a container another client is
    removing), is a container gone (None); another 500 stays an EngineError."""
    import anyio

    from sandbox_middleware.providers.docker._api import EngineAPI, EngineError

    body = json.dumps({"message": message}).encode()
    answer = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )

    async def serve(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.receive()
            await client.send(answer)

    path = str(tmp_path / "d.sock")
    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tasks:
        tasks.start_soon(listener.serve, serve)
        api = EngineAPI(path, "1.41", 5.0)
        try:
            if gone:
                assert await api.inspect("c1", "close c1") is None
            else:
                with pytest.raises(EngineError, match="something else broke"):
                    await api.inspect("c1", "close c1")
        finally:
            await api.aclose()
            tasks.cancel_scope.cancel()


# --- a snapshot's archive restored with its owner set (owned_stream) ------------------------------


def _tar(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def _entry(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.linkname = kind, len(data), 0o640, link
    info.uname = info.gname = "root"
    return info, data


async def _owned(archive: bytes, piece: int, owner: tuple[int, int] = (1_509_320_808, 1_509_320_808)) -> bytes:
    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(archive), piece):
            yield archive[start : start + piece]

    return b"".join([out async for out in owned_stream(chunks(), owner, "the test's archive", batch=4096)])


@pytest.mark.anyio
@pytest.mark.parametrize("piece", [1, 100, 512, 333, 1 << 20])
@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
async def test_an_archive_restored_keeps_every_byte_and_takes_the_new_owner(piece: int, fmt: int) -> None:
    """Docker's archive of ``<dir>/.``: its root ``./`` and devices are left out; every other entry keeps its
    name (long ones too: PAX or GNU headers), kind, link, mode and data, and is the new owner's (a uid
    of the host pool, past the octal field: base-256), however the stream is cut."""
    long = "./" + "d" * 60 + "/" + "e" * 70 + "/f" if fmt != tarfile.USTAR_FORMAT else "./" + "d" * 90 + "/f"
    blob = os.urandom(5000)
    members = [
        _entry("./", tarfile.DIRTYPE),
        _entry("./" + long.split("/")[1], tarfile.DIRTYPE),
        *([_entry("./" + "/".join(long.split("/")[1:3]), tarfile.DIRTYPE)] if long.count("/") > 2 else []),
        _entry(long, data=blob),
        _entry("./empty"),
        _entry("./link", tarfile.SYMTYPE, link="/etc/passwd"),
        _entry("./hard", tarfile.LNKTYPE, link=long),
        _entry("./null", tarfile.CHRTYPE),
        _entry("./fifo", tarfile.FIFOTYPE),
    ]
    out = await _owned(_tar(*members, fmt=fmt), piece)
    with tarfile.open(fileobj=io.BytesIO(out)) as archive:  # checksums checked as it reads
        got = archive.getmembers()
        data = archive.extractfile(long)
        assert data is not None and data.read() == blob
    expected = [info.name for info, _ in members if info.name != "./" and info.type != tarfile.CHRTYPE]
    assert [member.name for member in got] == [name.rstrip("/") for name in expected]
    assert all((m.uid, m.gid, m.uname, m.gname) == (1_509_320_808, 1_509_320_808, "", "") for m in got)
    assert [m.type for m in got][-3:] == [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE]
    assert got[-3].linkname == "/etc/passwd" and got[-2].linkname == long
    assert all(member.mode == 0o640 for member in got)
    assert out.endswith(b"\0" * 1024)


@pytest.mark.anyio
async def test_podmans_archive_without_a_root_entry_passes_and_small_ids_stay_octal() -> None:
    out = await _owned(_tar(_entry("sub", tarfile.DIRTYPE), _entry("sub/f", data=b"x")), 7, owner=(1000, 1001))
    with tarfile.open(fileobj=io.BytesIO(out)) as archive:
        assert [(m.name, m.uid, m.gid) for m in archive.getmembers()] == [("sub", 1000, 1001), ("sub/f", 1000, 1001)]


@pytest.mark.anyio
async def test_what_a_restore_does_not_expect_is_refused() -> None:
    owned = _entry("./f", data=b"x")
    owned[0].pax_headers = {"uid": "0"}  # an extended header naming an owner would override the one set
    with pytest.raises(SandboxError, match="naming an owner"):
        await _owned(_tar(owned), 512)
    sparse = _entry("./s")
    sparse[0].type = tarfile.GNUTYPE_SPARSE
    with pytest.raises(SandboxError, match="kind a snapshot cannot keep"):
        await _owned(_tar(sparse, fmt=tarfile.GNU_FORMAT), 512)
    whole = _tar(_entry("./f", data=b"y" * 2000))
    with pytest.raises(SandboxError, match="ended early"):
        await _owned(whole[:1024], 512)
