"""The host's shared pools and identity, per DockerProvider sandbox: a host uid of its own (leased from the pool
LocalProvider uses), open files, ptys, TCP buffers, message queues and inotify instances.

A hostile sandbox exhausts each pool from inside (``HOG``, holding what it took); then a second
sandbox of the same provider and host processes of other uids each open one of everything
(``PROBE``). Results are read from the kernel's own answers (errno) and, for TCP, from the
container's cgroup on the host.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_middleware import DockerProvider, SandboxCreateError, SandboxHandle, _protocol
from sandbox_middleware.providers._common import _uids

from ._daemon import private_daemon
from ._support import (
    BUSYBOX,
    PYTHON,
    RUNTIME,
    SESSION,
    SESSION_KEY,
    cannot_hold,
    engine,
    engine_kind,
    memory_cgroup,
    spec,
)

pytestmark = pytest.mark.anyio

_MiB = 1 << 20
_HOST_PYTHON = "/usr/bin/python3"  # the test image's python is this one (scripts/build-docker-images.sh)

_LIBC = """
import ctypes, errno, json, os, socket, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)

def checked(value):
    if value < 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return value

def inotify():
    return checked(libc.inotify_init1(0))

def mqueue(name):
    return checked(libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, ctypes.c_uint(0o600), None))

def name_of(exc):
    return errno.errorcode.get(exc.errno, str(exc)) if isinstance(exc, OSError) and exc.errno else type(exc).__name__
"""

HOG = (
    _LIBC
    + """
pool, report, argument = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []

def until_error(open_one):
    while True:
        try:
            held.append(open_one())
        except OSError as exc:
            return len(held), name_of(exc)

if pool == "inotify":
    count, error = until_error(inotify)
    result = {"count": count, "error": error}
elif pool == "mqueue":
    count, error = until_error(lambda: mqueue(f"/hog{len(held)}"))
    result = {"count": count, "error": error}
elif pool == "pty":
    count, error = until_error(os.openpty)
    result = {"count": count, "error": error}
elif pool == "files":  # ARGUMENT processes, each opening files until it may open no more
    read, write = os.pipe()
    for _ in range(argument):
        if os.fork() == 0:
            count, error = until_error(lambda: os.eventfd(0))
            os.write(write, (json.dumps([count, error]) + "\\n").encode())
            time.sleep(3600)
    replies = os.fdopen(read)
    lines = [json.loads(replies.readline()) for _ in range(argument)]
    counts, errors = [n for n, _ in lines], sorted({e for _, e in lines})
    result = {"per_process": max(counts), "total": sum(counts), "errors": errors}
elif pool == "tcp":  # queue bytes on loopback connections nobody reads, up to ARGUMENT bytes
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1024)
    total, starved, error, chunk = 0, 0, None, b"x" * (1 << 20)
    while total < argument and starved < 3:
        try:
            client = socket.create_connection(server.getsockname(), timeout=5)
            held += [client, server.accept()[0]]
        except OSError as exc:
            error = name_of(exc)
            break
        client.setblocking(False)
        queued = 0
        while total < argument:
            try:
                sent = client.send(chunk)
            except BlockingIOError:
                break
            queued, total = queued + sent, total + sent
        starved = starved + 1 if queued < (64 << 10) else 0  # a fresh connection queues next to nothing
    result = {"bytes": total, "connections": len(held) // 2, "error": error}
with open(report + ".part", "w") as out:
    json.dump(result, out)
os.rename(report + ".part", report)
time.sleep(3600)
"""
)

PROBE = (
    _LIBC
    + """
results = {}

def attempt(pool, open_one):
    try:
        open_one()
        results[pool] = "ok"
    except Exception as exc:
        results[pool] = name_of(exc)

def one_queue():
    name = f"/probe{os.getpid()}"
    os.close(mqueue(name))
    libc.mq_unlink(name.encode())

def one_connection():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname(), timeout=5)
    peer = server.accept()[0]
    peer.settimeout(5)
    client.sendall(b"y" * (256 << 10))
    got = 0
    while got < 256 << 10:
        got += len(peer.recv(1 << 20))

attempt("inotify", lambda: os.close(inotify()))
attempt("mqueue", one_queue)
attempt("files", lambda: [os.close(os.eventfd(0)) for _ in range(64)])
attempt("pty", lambda: [os.close(fd) for fd in os.openpty()])
attempt("tcp", one_connection)
print(json.dumps(results))
"""
)


async def _hog(provider: DockerProvider, handle: SandboxHandle, pool: str, argument: int = 0) -> dict[str, Any]:
    """Start the hostile ``pool`` exhaustion in the background of ``handle``; what it took, once it holds it."""
    report = f"/tmp/{pool}.json"
    started = await provider.exec(handle, f"python3 /tmp/hog.py {pool} {report} {argument} >/tmp/{pool}.err 2>&1 &")
    assert started.return_code == 0, started
    with anyio.fail_after(120):
        while True:
            done = await provider.exec(handle, f"cat {report} 2>/dev/null || cat /tmp/{pool}.err >&2")
            if done.stdout:
                return dict(json.loads(done.stdout))
            assert "Error" not in done.stderr, done.stderr
            await anyio.sleep(0.2)


async def _probe(provider: DockerProvider, handle: SandboxHandle) -> dict[str, str]:
    result = await provider.exec(handle, "python3 /tmp/probe.py", timeout_s=60)
    assert result.return_code == 0, result
    return dict(json.loads(result.stdout))


def _as_uid(uid: int, code: str, *args: str) -> str:
    """What python ``code`` prints in a host process of ``uid`` (its gid alike, no supplementary groups)."""
    done = subprocess.run(
        [_HOST_PYTHON, "-c", code, *args],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


_READER = """
import sys
for pid in sys.argv[1:]:
    try:
        open(f"/proc/{pid}/environ", "rb").read()
        print("read")
    except PermissionError:
        print("denied")
"""


def _uid(provider_result: _protocol.SandboxExecResult) -> int:
    return int(provider_result.stdout.strip())


def _needs_root_beside_the_daemon(provider: DockerProvider) -> None:
    if os.geteuid() != 0 or not os.path.exists(_HOST_PYTHON):
        pytest.skip(f"needs root beside the daemon (host processes of other uids) and {_HOST_PYTHON}")
    if "v1 memory.kmem.tcp" not in provider.mechanisms["tcp buffers"]:
        pytest.skip(f"TCP buffers here: {provider.mechanisms['tcp buffers']} (the v1 bound is what this test reads)")


async def test_one_sandbox_exhausting_each_pool_leaves_the_other_and_the_host_theirs(
    make: Callable[..., DockerProvider],
) -> None:
    """Two concurrent sandboxes of default limits (``ptys=16``, so there are ptys to take): the first
    takes every inotify instance, message queue byte, open file, pty and TCP buffer byte it can; the
    second, and host processes of uid 65534 and root, still open one of each (Podman: no ptys, which it
    cannot mount, ``ptys=0``)."""
    cannot_hold(
        "runsc",
        "gVisor's Sentry implements inotify, message queues, ptys and TCP itself: a sandbox takes nothing of the "
        "host's per-uid pools (RLIMIT_NOFILE bounds its inotify instances instead)",
    )
    ptys = 0 if engine_kind() == "podman" else 16
    provider = make(ptys=ptys)
    _needs_root_beside_the_daemon(provider)
    files = {"/tmp/hog.py": HOG, "/tmp/probe.py": PROBE}
    hostile, other = [await provider.create(spec(PYTHON, files=files)) for _ in range(2)]
    uids = [_uid(await provider.exec(box, "id -u")) for box in (hostile, other)]
    assert uids[0] != uids[1]
    taken = {
        "inotify": await _hog(provider, hostile, "inotify"),
        "mqueue": await _hog(provider, hostile, "mqueue"),
        "pty": await _hog(provider, hostile, "pty"),
        "files": await _hog(provider, hostile, "files", 16),
        "tcp": await _hog(provider, hostile, "tcp", 1 << 30),
    }
    instances = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    assert taken["inotify"] == {"count": instances, "error": "EMFILE"}, taken
    assert taken["mqueue"]["error"] == "EMFILE" and taken["mqueue"]["count"] >= 1, taken  # RLIMIT_MSGQUEUE
    assert taken["pty"] == ({"count": 16, "error": "ENOSPC"} if ptys else {"count": 0, "error": "EACCES"}), taken
    assert taken["files"]["errors"] == ["EMFILE"] and 200 < taken["files"]["per_process"] < 256, taken
    limit = memory_cgroup(hostile.sandbox_id) / "memory.kmem.tcp.limit_in_bytes"
    assert int(limit.read_text()) == 64 * _MiB
    peak = int((limit.parent / "memory.kmem.tcp.max_usage_in_bytes").read_text())
    assert taken["tcp"]["bytes"] < 128 * _MiB and peak <= 65 * _MiB, (taken, peak)  # of a 1 GiB try
    everything = dict.fromkeys(("inotify", "mqueue", "files", "pty", "tcp"), "ok")
    assert await _probe(provider, other) == {**everything, **({} if ptys else {"pty": "EACCES"})}
    for uid in (65534, 0):
        assert json.loads(_as_uid(uid, PROBE)) == everything, uid
    assert (await _probe(provider, hostile))["inotify"] == "EMFILE"  # the hostile one still holds them
    await provider.close(hostile)
    await provider.close(other)


async def test_default_sandboxes_have_no_pty_and_bounded_files(make: Callable[..., DockerProvider]) -> None:
    """By default /dev/pts is an empty read-only tmpfs (no pty at all, /dev/ptmx opens nothing), and
    RLIMIT_NOFILE is 256, soft and hard, in the main process and in commands."""
    provider = make()
    handle = await provider.create(spec(PYTHON))
    opened = await provider.exec(handle, "python3 -c 'import os; os.openpty()'")
    # runc: /dev/ptmx links into the empty /dev/pts; gVisor (runsc) refuses the read-only mount's ptmx instead;
    # Podman's /dev/ptmx is a device node the sandbox's uid may not open
    assert opened.return_code == 1 and re.search("No such file|Read-only|Permission denied", opened.stderr), opened
    limits = await provider.exec(handle, "ulimit -Sn; ulimit -Hn; grep -E 'open files|msgqueue' /proc/1/limits")
    assert limits.stdout.split()[:2] == ["256", "256"]
    if RUNTIME != "runsc":  # gVisor's /proc has no limits file
        assert "256                  256" in limits.stdout and "819200               819200" in limits.stdout
    assert provider.mechanisms["pty"] == "none: /dev/pts is an empty read-only tmpfs"
    await provider.close(handle)


async def test_no_host_process_but_root_reads_a_sandbox_environment(provider: DockerProvider) -> None:
    """spec.env and a command's env are in the sandbox's processes' /proc/PID/environ: host processes of
    uid 65534 (the host's nobody, which every sandbox was before) and of the other sandbox's uid cannot
    read them (nor ptrace them: the same check); root can."""
    if os.geteuid() != 0 or not os.path.exists(_HOST_PYTHON):
        pytest.skip(f"needs root beside the daemon (host processes of other uids) and {_HOST_PYTHON}")
    cannot_hold(
        "runsc",
        "no process of a gVisor sandbox is a host process (the env lives in the Sentry's memory; docker top lists "
        "the host's pids 1 and 2)",
    )
    secret, call_secret = "spec-secret-4f1c", "call-secret-9d2e"
    handle = await provider.create(spec(PYTHON, env={"TOKEN": secret}))
    other = await provider.create(spec(PYTHON))
    await provider.exec(handle, "sleep 300 >/dev/null 2>&1 &", env={"CALL_TOKEN": call_secret})
    with engine() as client:
        hpid = engine_kind() == "podman"  # Podman's top lists the container's pids unless asked for the host's
        top = client.get(f"/containers/{handle.sandbox_id}/top", params={"ps_args": "hpid"} if hpid else {}).json()
    pids = [int(row[top["Titles"].index("HPID" if hpid else "PID")]) for row in top["Processes"]]
    environs = {pid: Path(f"/proc/{pid}/environ").read_bytes() for pid in pids}  # as root
    assert any(secret.encode() in env for env in environs.values())
    assert any(call_secret.encode() in env for env in environs.values())
    for uid in (65534, _uid(await provider.exec(other, "id -u"))):
        assert _as_uid(uid, _READER, *map(str, pids)).split() == ["denied"] * len(pids), uid
    await provider.close(handle)
    await provider.close(other)


@pytest.mark.xdist_group("docker-forced-uids")  # its variants side by side would draw the same uids
async def test_live_sandboxes_never_share_a_uid_and_close_or_removal_frees_it(
    make: Callable[..., DockerProvider], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the random draw forced to repeat, two live sandboxes get two uids; a LocalProvider-style lease
    skips both though this process holds no lock on them (their containers do, by claim); a container
    removed behind the provider's back (the TTL watchdog, by hand) frees its uid; close frees it at once.
    No spares: each holds a uid of its own too (test_spares.py), which would take the next one here."""
    first_uid = _uids.UID_BASE + 1_000_011  # far from the LocalProvider tests' forced draws (UID_BASE + 7 on)
    monkeypatch.setattr(_uids, "draw", lambda: first_uid)
    provider = make(prestart=False)
    first, second = await provider.create(spec()), await provider.create(spec())
    assert [_uid(await provider.exec(box, "id -u")) for box in (first, second)] == [first_uid, first_uid + 1]
    local = _uids.lease_uid(_uids.lease_directory())
    assert local.uid == first_uid + 2
    local.release()
    with engine() as client:
        client.delete(f"/containers/{first.sandbox_id}", params={"force": "1", "v": "1"}).raise_for_status()
    third = await provider.create(spec())  # the claim of a container the daemon no longer has is free
    assert _uid(await provider.exec(third, "id -u")) == first_uid
    for handle in (second, third):
        await provider.close(handle)
    assert not (_uids.lease_directory() / str(first_uid)).exists()
    assert not (_uids.lease_directory() / str(first_uid + 1)).exists()


_MAKER = """
import sys, anyio
from sandbox_middleware import DockerProvider, SandboxSpec
from sandbox_middleware.providers._common import _uids
_uids.draw = lambda: int(sys.argv[1])  # every process draws the same uid first

async def main():
    provider = DockerProvider(prestart=False)  # a spare drawing first would take the forced uid
    handle = await provider.create(SandboxSpec(image=sys.argv[2], metadata={sys.argv[3]: sys.argv[4], "maker": "gone"}))
    print((await provider.exec(handle, "id -u")).stdout.strip())  # and exits, its sandbox left running

anyio.run(main)
"""


@pytest.mark.xdist_group("docker-forced-uids")
async def test_a_sandbox_outliving_its_maker_keeps_its_uid(
    make: Callable[..., DockerProvider], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that made a sandbox and exited (its lease's lock gone with it) leaves the uid held by the
    container's claim: another process drawing the same uid gets the next one; closing the listed
    sandbox frees it."""
    first_uid = _uids.UID_BASE + 1_000_023
    provider = make(prestart=False)  # a spare's maker drawing the same uid would hold its lock at the close
    try:
        done = await anyio.run_process(
            [sys.executable, "-c", _MAKER, str(first_uid), BUSYBOX, SESSION_KEY, SESSION], check=False
        )
        assert done.returncode == 0, done.stderr.decode()
        assert int(done.stdout) == first_uid
        monkeypatch.setattr(_uids, "draw", lambda: first_uid)
        handle = await provider.create(spec())
        assert _uid(await provider.exec(handle, "id -u")) == first_uid + 1
        (left,) = await provider.list(metadata={"maker": "gone", SESSION_KEY: SESSION})
        await provider.close(left.handle)
        assert not (_uids.lease_directory() / str(first_uid)).exists()
        await provider.close(handle)
    finally:  # the maker's sandbox is no provider's here: a failure above would leave it to later tests' lists
        for listing in await provider.list(metadata={"maker": "gone", SESSION_KEY: SESSION}):
            await provider.close(listing.handle)


async def test_reap_from_another_provider_frees_the_uid(make: Callable[..., DockerProvider]) -> None:
    """close of a listed handle (what reap does) in a provider that did not make the sandbox frees its uid."""
    maker, reaper = make(), make()
    handle = await maker.create(spec(metadata={"reaped": "yes"}))
    uid = _uid(await maker.exec(handle, "id -u"))
    assert (_uids.lease_directory() / str(uid)).exists()
    (listing,) = await reaper.list(metadata={"reaped": "yes"})
    await reaper.close(listing.handle)
    assert not (_uids.lease_directory() / str(uid)).exists()


@pytest.mark.parametrize("image_user", ["root:root", "0:1000", "00", "0", "root", "sandbox"])
async def test_an_image_user_of_any_spelling_never_makes_commands_root(
    make: Callable[..., DockerProvider], image_user: str
) -> None:
    """Images whose USER is root in spellings the old check missed (``root:root``, ``0:1000``, ``00``)
    and a named user run as the sandbox's own uid, like every other image."""
    cannot_hold("podman", "its Docker-compatible /commit (which makes the test's images) answers 500 here")
    provider = make(prestart=False)  # no spare of the test's image: one would keep it from being removed
    tag = f"sandbox-middleware/user-test:{uuid.uuid4().hex[:12]}"
    with engine() as client:
        base = client.post("/containers/create", json={"Image": PYTHON, "Cmd": ["true"]}).json()["Id"]
        try:
            made = client.post("/commit", params={"container": base, "repo": tag, "changes": f"USER {image_user}"})
            made.raise_for_status()
        finally:
            client.delete(f"/containers/{base}", params={"force": "1"})
    try:
        handle = await provider.create(spec(tag))
        ids = (await provider.exec(handle, "id -u; id -g; cat /proc/1/status | grep -E '^(Uid|Gid)'")).stdout.split()
        uid = int(ids[0])
        assert uid >= _uids.UID_BASE and ids[1] == ids[0] and ids[3:7] == [str(uid)] * 4, ids
        await provider.close(handle)
    finally:
        with engine() as client:  # by its id: the image itself goes, not only its tag (no dangling image left)
            image = made.json()["Id"]
            client.delete(f"/images/{image}", params={"force": "1"})
            assert client.get(f"/images/{image}/json").status_code == 404


async def test_output_that_looks_like_a_runtime_failure_is_the_commands_result(provider: DockerProvider) -> None:
    """A command printing the runtime's error text and exiting 127 (or 126) is a result, not a SandboxError:
    only the daemon's exec inspect (Pid 0: nothing started) says the runtime failed."""
    handle = await provider.create(spec())
    forged = "OCI runtime exec failed: exec failed: unable to start container process: fake: unknown"
    for code in (127, 126):
        result = await provider.exec(handle, f"echo '{forged}'; exit {code}")
        assert (result.stdout, result.return_code, result.error_type) == (forged + "\n", code, None)
    await provider.close(handle)


_REMAP_BASE, _REMAP_SIZE = 200_000, 1_600_000_000  # a range holding the whole pool (its top: 1,516,777,216)


@pytest.fixture
def remap_ranges() -> Iterator[str]:
    """Subordinate uid and gid ranges of ``nobody`` in /etc/subuid and /etc/subgid, for a private dockerd
    with ``--userns-remap=nobody:nogroup``; the lines added are removed afterwards."""
    if os.geteuid() != 0 or shutil.which("dockerd") is None or shutil.which("unshare") is None:
        pytest.skip(
            "needs root, dockerd and unshare to start a private dockerd with --userns-remap: as root, "
            "apt-get install docker.io util-linux"
        )
    try:
        pwd.getpwnam("nobody")
        grp.getgrnam("nogroup")
    except KeyError:
        pytest.skip("needs the user nobody and the group nogroup (Debian's) to remap to")
    line = f"nobody:{_REMAP_BASE}:{_REMAP_SIZE}\n"
    files = [Path("/etc/subuid"), Path("/etc/subgid")]
    if any("\nnobody:" in "\n" + path.read_text() for path in files if path.exists()):
        pytest.skip("nobody has subordinate ranges already: not changed by a test")
    try:
        for path in files:
            with path.open("a") as ranges:
                ranges.write(line)
        yield "nobody:nogroup"
    finally:
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                path.write_text(path.read_text().replace(line, ""))


@pytest.mark.xdist_group("userns-remap")  # its two backends in one worker: each adds and removes nobody's ranges
async def test_a_daemon_remapping_uids_runs_each_sandbox_as_its_range_base_plus_its_own_uid(
    remap_ranges: str, make: Callable[..., DockerProvider]
) -> None:
    """Against a private dockerd with --userns-remap whose range holds the pool: each sandbox runs as its
    leased uid inside and base + that uid on the host, its writable directories usable; a uid outside
    the range is a create error saying what to do."""
    with private_daemon(remap=remap_ranges) as daemon:
        provider = make(socket=daemon.socket, runtime=None)  # the private dockerd registers no other runtime
        assert "the daemon remaps uids" in provider.mechanisms["user"]
        handle = await provider.create(spec(BUSYBOX, files={"seed.txt": "s"}))
        inside = _uid(await provider.exec(handle, "id -u"))
        with engine(daemon.socket) as client:
            pid = client.get(f"/containers/{handle.sandbox_id}/json").json()["State"]["Pid"]
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"Uid:\t{_REMAP_BASE + inside}\t" in status, status
        written = await provider.exec(handle, "echo w > w.txt && echo t > /tmp/t && stat -c %u seed.txt w.txt /tmp/t")
        assert written.stdout.split() == [str(inside)] * 3, written
        await provider.close(handle)
        outside = make(socket=daemon.socket, runtime=None, user=f"{_REMAP_SIZE + 1}:{_REMAP_SIZE + 1}")
        with pytest.raises(SandboxCreateError, match=r"remaps uids .* through a range without this sandbox's uid"):
            await outside.create(spec(BUSYBOX))
