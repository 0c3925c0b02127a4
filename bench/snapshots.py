"""Prepare once and fork, against preparing every time and uploading every time: the time to 8 ready
sandboxes holding one state, and the storage they use, side by side in one run.

Run: python bench/snapshots.py [--provider local|docker] [--files 10000] [--megabytes 200] [--forks 8]

The state: ``--megabytes`` of random bytes in ``--files`` files (100 to a directory), as a task's
preparation leaves it (a clone, its dependencies, a build). Three ways to ``--forks`` sandboxes
holding it, each through the recommended stack, one after the other:

- fork: one sandbox prepares the state (a Python script writes the files), then ``Sandbox.fork``:
  one snapshot (the parent's first) and the creates from it at once; then a second group of the
  same parent (a later snapshot, stopped at once: a group retried, or the next of a task), and the
  parent is closed (the state lives on in the first forks). A snapshot of another sandbox prepared
  the same way, taken alone just before (and deleted), says how much of the fork's time is the
  snapshot's, and how much the creates';
- prepare every time: as many sandboxes at once, each running the preparation;
- upload every time: as many sandboxes at once, each getting the files from a copy on this machine as
  one tar archive (one ``upload_file``, then unpacked in the sandbox: one ``upload_file`` per file
  cost 56 ms each on the shared machine's Docker, 1,000 files x 8 sandboxes in 450 s).

Each is timed from its first call to the last sandbox ready, and every sandbox is checked to hold the
whole state (untimed). Its storage is what the machine holds while the sandboxes are held, less what
it held before: the used blocks of the filesystem the provider keeps sandboxes and snapshots on
(``base_dir``; Docker's root directory) plus shared memory, where tmpfs pages count (both sandboxes'
work directories are tmpfs), after a sync. References: one empty create (the median of 3 on a
provider with ``prestart=False``, which takes no spare made ahead; the default provider's, taking
its spare, is printed beside it) and one copy (the storage of the prepared parent before the fork).

Goals (issue 30): ``LocalProvider``'s 8 forks ready within 3x one empty create, using under 1.2x
the storage of one copy; ``DockerProvider``'s 8 forks ready within 2x one create.
The storage is measured machine-wide: other work on the machine shows in it, as the load printed does.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from sandbox_middleware import (
    DockerProvider,
    LocalProvider,
    Sandbox,
    SandboxProvider,
    SandboxSpec,
    SupportsSandboxSnapshot,
    recommended_middleware,
    stack,
)

IMAGE = "sandbox-middleware/python:test"
PER_DIRECTORY = 100
UNPACK = "import os, tarfile; tarfile.open('state.tar').extractall(); os.remove('state.tar')"
PREPARE = """\
import os, sys
files, size = int(sys.argv[1]), int(sys.argv[2])
for number in range(files):
    directory = f"state/{number // 100:04d}"
    os.makedirs(directory, exist_ok=True)
    with open(f"{directory}/{number % 100:02d}.bin", "wb") as out:
        out.write(os.urandom(size))
"""
COUNT = """\
import os
sizes = [os.path.getsize(os.path.join(directory, name)) for directory, _, names in os.walk("state") for name in names]
print(len(sizes), sum(sizes))
"""


def storage_used(where: Path) -> int:
    """Bytes used now on ``where``'s filesystem plus shared memory (tmpfs pages), after a sync."""
    os.sync()
    stat = os.statvfs(where)
    meminfo = Path("/proc/meminfo").read_text()
    shared = re.search(r"^Shmem:\s+(\d+) kB$", meminfo, re.MULTILINE)
    assert shared is not None, "no Shmem line in /proc/meminfo"
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize + int(shared.group(1)) * 1024


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.size = args.megabytes * 1_000_000 // args.files
        self.spec = SandboxSpec(image=IMAGE if args.provider == "docker" else None)
        if args.provider == "docker":
            root = subprocess.run(
                ["docker", "info", "--format", "{{.DockerRootDir}}"], capture_output=True, text=True, check=True
            ).stdout.strip()
            self.where = Path(root if root and Path(root).exists() else "/")
        else:
            scratch.chmod(0o711)  # the sandboxes' own uids reach base_dir through it
            self.where = scratch / "boxes"
            self.where.mkdir()
        (scratch / "prepare.py").write_text(PREPARE)
        self.archive = scratch / "state.tar"  # what the upload contender uploads, written before it runs
        # Untimed, before a group: its spares made again (a container's start is ~0.25 s, a bwrap sandbox's 35 ms).
        self.refill_s = max(2.0, 0.5 * args.spares) if args.provider == "docker" else 2.0

    def provider(self, **options: Any) -> SandboxProvider:
        if self.args.provider == "docker":
            return DockerProvider(**options)
        return LocalProvider(base_dir=self.where, **options)

    async def ready(self, sandbox: Sandbox) -> None:
        """The sandbox holds the whole state (untimed)."""
        done = await sandbox.exec(f"python3 -c {shlex.quote(COUNT)}", timeout_s=300)
        expected = f"{self.args.files} {self.args.files * self.size}"
        assert (done.stdout or "").strip() == expected, (done.stdout, done.stderr, expected)

    async def prepare(self, sandbox: Sandbox) -> None:
        await sandbox.upload(self.scratch / "prepare.py", "prepare.py")
        done = await sandbox.exec(f"python3 prepare.py {self.args.files} {self.size} && rm prepare.py", timeout_s=900)
        assert done.return_code == 0, done.stderr

    async def upload(self, sandbox: Sandbox) -> None:
        await sandbox.upload(self.archive, "state.tar")
        done = await sandbox.exec(f"python3 -c {shlex.quote(UNPACK)}", timeout_s=900)
        assert done.return_code == 0, done.stderr

    def write_archive(self) -> None:
        """The state as a tar archive on this machine, its files written one by one first."""
        local = self.scratch / "local"
        for number in range(self.args.files):
            path = local / "state" / f"{number // PER_DIRECTORY:04d}" / f"{number % PER_DIRECTORY:02d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(self.size))
        with tarfile.open(self.archive, "w") as archive:
            archive.add(local / "state", "state")

    async def empty_creates(self) -> tuple[float, float]:
        """The median of 3 empty creates without a spare, and of 3 taking the default provider's spare."""
        medians = []
        for options in ({"prestart": False}, {}):
            provider = stack(self.provider(**options), recommended_middleware())
            times = []
            try:
                for _ in range(3):
                    sandbox = Sandbox(provider, self.spec)
                    started = time.perf_counter()
                    await sandbox.start()
                    times.append(time.perf_counter() - started)
                    await sandbox.stop()
                    await anyio.sleep(1.0)  # the spare of the next create is made meanwhile (untimed)
            finally:
                await provider.aclose()
            medians.append(statistics.median(times))
        return medians[0], medians[1]

    async def snapshot_alone(self, provider: SandboxProvider) -> float:
        """A snapshot of another sandbox prepared the same way, taken and deleted: what of a fork's time
        the snapshot is (s). Another sandbox, so that the fork timed next takes its parent's first snapshot."""
        assert isinstance(provider, SupportsSandboxSnapshot), f"{provider!r} takes no snapshots"
        async with Sandbox(provider, self.spec) as other:
            await self.prepare(other)
            started = time.perf_counter()
            alone = await other.snapshot()
            elapsed = time.perf_counter() - started
            await provider.delete_snapshot(alone)
        return elapsed

    async def fork(self, provider: SandboxProvider) -> tuple[float, float, float, int, int]:
        """Prepare once, then fork: (prepare s, fork s, the same parent forked again s, one copy's storage,
        the first forks')."""
        before = storage_used(self.where)
        parent = Sandbox(provider, self.spec)
        forks: list[Sandbox] = []
        try:
            started = time.perf_counter()
            await parent.start()
            await self.prepare(parent)
            prepared = time.perf_counter() - started
            one_copy = storage_used(self.where) - before
            await anyio.sleep(self.refill_s)  # untimed: the spares the parent's create took are made again
            started = time.perf_counter()
            forks = await parent.fork(self.args.forks)
            forked = time.perf_counter() - started
            await anyio.sleep(self.refill_s)
            started = time.perf_counter()
            async with parent.fork(self.args.forks):  # a later group of the same state (stopped at once)
                again = time.perf_counter() - started
            await parent.stop()
            held = storage_used(self.where) - before
            for sandbox in forks:
                await self.ready(sandbox)
        finally:
            for sandbox in [parent, *forks]:
                await sandbox.stop()
        return prepared, forked, again, one_copy, held

    async def every_time(
        self, provider: SandboxProvider, make: Callable[[Sandbox], Awaitable[None]]
    ) -> tuple[float, int]:
        """``--forks`` sandboxes at once, each made ready by ``make``: (s, storage)."""
        before = storage_used(self.where)
        sandboxes = [Sandbox(provider, self.spec) for _ in range(self.args.forks)]

        async def one(sandbox: Sandbox) -> None:
            await sandbox.start()
            await make(sandbox)

        try:
            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for sandbox in sandboxes:
                    group.start_soon(one, sandbox)
            elapsed = time.perf_counter() - started
            held = storage_used(self.where) - before
            for sandbox in sandboxes:
                await self.ready(sandbox)
        finally:
            with anyio.CancelScope(shield=True):
                for sandbox in sandboxes:
                    await sandbox.stop()
        return elapsed, held

    async def run(self) -> None:
        args = self.args
        load = os.getloadavg()[0]
        cold, spare = await self.empty_creates()
        provider = stack(self.provider(spares=args.spares), recommended_middleware())
        try:
            snapshot = await self.snapshot_alone(provider)
            prepared, forked, again, one_copy, forks_held = await self.fork(provider)
            prepare_time, prepare_held = await self.every_time(provider, self.prepare)
            self.write_archive()
            upload_time, upload_held = await self.every_time(provider, self.upload)
        finally:
            await provider.aclose()
        n = args.forks

        def copies(held: int) -> str:
            return f"storage {held / one_copy:.2f}x one copy"

        fork_goals = f"goal <= {3 if args.provider == 'local' else 2}x" + (
            "; < 1.2x" if args.provider == "local" else ""
        )
        rows = [
            (
                "one empty create, no spare",
                f"{cold * 1e3:.1f} ms",
                f"taking the spare made ahead: {spare * 1e3:.1f} ms",
            ),
            ("preparing it once", f"{prepared:.2f} s", f"one copy: {one_copy / 1e6:.0f} MB"),
            (
                f"fork: snapshot + {n} creates",
                f"{forked:.3f} s",
                f"{forked / cold:.2f}x one empty create, {copies(forks_held)} ({fork_goals})",
            ),
            (
                "  of which a snapshot, alone",
                f"{snapshot:.3f} s",
                f"the {n} creates from it: {forked - snapshot:.3f} s (the same state snapshotted apart)",
            ),
            (f"  a later fork of {n} of it", f"{again:.3f} s", f"{again / cold:.2f}x one empty create"),
            (f"preparing it {n} times at once", f"{prepare_time:.2f} s", copies(prepare_held)),
            (f"uploading it {n} times at once", f"{upload_time:.2f} s", copies(upload_held)),
        ]
        print(
            f"snapshots, {args.provider} provider: a state of {args.megabytes} MB in {args.files:,} files, {n} "
            f"sandboxes holding it (load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)"
            + f"; the provider keeps {args.spares} spares"
        )
        for label, value, rest in rows:
            print(f"  {label + ':':<34} {value:>10}   {rest}")
        print(
            f"  prepare once + fork vs preparing {n} times: {(prepared + forked) / prepare_time:.2f}x the time; "
            f"vs uploading {n} times: {(prepared + forked) / upload_time:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["local", "docker"], default="local")
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--forks", type=int, default=8)
    parser.add_argument(
        "--spares", type=int, default=None, help="the provider's spares (default: --forks, the group recipe's)"
    )
    args = parser.parse_args()
    if args.spares is None:
        args.spares = args.forks
    with tempfile.TemporaryDirectory(prefix="bench-snapshots-") as scratch:
        anyio.run(Bench(args, Path(scratch)).run)


if __name__ == "__main__":
    main()
