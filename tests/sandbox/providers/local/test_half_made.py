"""Nothing half-made is left for ever: a process SIGKILLed at any point while it makes (or removes) a
sandbox or a spare leaves a directory, cgroups and a mount without a record, but its maker file names
it; the next provider on that base_dir, or reap, removes them once it is dead, and never while it lives.

Each case is a real process killed by a real SIGKILL at a checkpoint: a hook the child installs on
one step of the make (after the provider is built), which kills it there (or holds it there alive)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import LocalProvider, reap
from sandbox_middleware.providers._common import _uids
from sandbox_middleware.providers.local._cgroups import CgroupBackend
from sandbox_middleware.providers.local._records import MAKER, remove_box
from tests.leftovers import mounts_below
from tests.providers import in_own_pid_namespace

pytestmark = pytest.mark.anyio

_CHILD = """
import anyio, os, signal, sys, time
from sandbox_middleware import LocalProvider, SandboxSpec
from sandbox_middleware.providers.local import _provider, _records

base, isolation, point, then = sys.argv[1:5]
provider = LocalProvider(isolation=isolation, base_dir=base, prestart=point == "spare record")
WHERE = {  # (object, attribute, before or after the call, the file name the call writes if it matters)
    "maker file": (_provider.tempfile, "mkdtemp", "before", None),
    "directory": (_provider.tempfile, "mkdtemp", "after", None),
    "cgroups": (type(provider._cgroups), "create", "after", None),
    "mount": (_provider, "mount_tmpfs", "after", None),
    "layout": (_provider, "lay_out", "after", None),
    "record": (_provider, "write_private", "before", _records.RECORD),
    "starter": (LocalProvider, "_start_starter", "after", None),
    "spare record": (_provider, "write_private", "before", _records.SPARE_RECORD),
    "removal": (_records, "remove_tree", "before", None),
}
owner, name, when, written = WHERE[point]
real = getattr(owner, name)

def stop():
    print(point, flush=True)
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)

def hooked(*args, **kwargs):
    if when == "before" and (written is None or written in args):
        stop()
    result = real(*args, **kwargs)
    if when == "after":
        stop()
    return result

setattr(owner, name, hooked)

async def main():
    handle = await provider.create(SandboxSpec())
    await provider.close(handle)  # "removal" stops in here; "spare record" in the refill after the create
    await anyio.sleep(600)

anyio.run(main)
"""

_PLAIN = ["maker file", "directory", "cgroups", "mount", "layout", "record", "removal"]
_BWRAP = ["starter", "spare record"]


@asynccontextmanager
async def stopped_at(base: Path, isolation: str, point: str, then: str) -> AsyncIterator[int]:
    """A child making a sandbox in ``base``, killed (``then="kill"``) or held alive at ``point`` (its pid
    yielded); SIGKILLed after in any case."""
    argv = [sys.executable, "-c", _CHILD, str(base), isolation, point, then]
    async with await anyio.open_process(argv) as child:
        try:
            assert child.stdout is not None
            said = b""
            with anyio.fail_after(60):
                while not said.endswith(b"\n"):
                    said += await child.stdout.receive()
            assert said.decode().strip() == point
            if then == "kill":
                await child.wait()
                assert child.returncode == -signal.SIGKILL
            yield child.pid
        finally:
            if child.returncode is None:
                child.send_signal(signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await child.wait()


def _left(base: Path) -> tuple[list[str], list[str], list[str]]:
    """What is in ``base``: its entries, the mounts below it, and the cgroups of the sandboxes named there."""
    names = sorted(os.listdir(base))
    ids = {name[:18] for name in names}
    groups = [str(group) for sandbox_id in ids for group in CgroupBackend().groups_of(sandbox_id)]
    return names, mounts_below(base), groups


def _leases_of(pid: int) -> list[str]:
    """The host uid leases (``_uids.LEASES``) whose maker is process ``pid``."""
    found = []
    for lease in _uids.LEASES.glob("*") if os.geteuid() == 0 else []:
        with contextlib.suppress(FileNotFoundError):  # released meanwhile (another test's)
            if lease.read_text() == f"{pid}\n":
                found.append(lease.name)
    return found


def _check_machine(point: str) -> None:
    if point == "cgroups" and not CgroupBackend().resources:
        pytest.skip("no writable cgroup controllers here: a sandbox has no cgroups to leave")
    if point == "mount" and os.geteuid() != 0:
        pytest.skip("not root: a sandbox has no mount of its own to leave")


@pytest.mark.parametrize(
    ("isolation", "point"),
    [("none", point) for point in _PLAIN]
    + [pytest.param("bwrap", point, marks=pytest.mark.requires_bwrap) for point in _BWRAP],
)
async def test_a_maker_killed_at_each_point_leaves_what_the_next_provider_removes(
    sandbox_base: Path, isolation: str, point: str
) -> None:
    _check_machine(point)
    sandbox_base.mkdir(parents=True)
    async with stopped_at(sandbox_base, isolation, point, "kill") as pid:
        names, _, _ = _left(sandbox_base)
        assert [name for name in names if name.endswith(MAKER)], names  # its trail
        if point in ("mount", "layout", "record", "starter"):
            assert mounts_below(sandbox_base), "a half-made sandbox with its tmpfs is what this is about"
        if isolation == "bwrap" and os.geteuid() == 0:
            assert _leases_of(pid), "as root each bwrap sandbox leases a uid: its file outlives the kill"
    provider = LocalProvider(isolation=isolation, base_dir=sandbox_base, prestart=False)  # sweeps
    try:
        assert _left(sandbox_base) == ([], [], [])
        assert _leases_of(pid) == []
    finally:
        await provider.aclose()


async def test_reap_removes_a_dead_makers_leftovers_and_never_a_live_makers_work(sandbox_base: Path) -> None:
    """With the maker alive and held at its mount, neither a new provider nor reap touches its work;
    killed, reap (of a provider made before, which swept nothing then) removes it and reports it."""
    _check_machine("mount")
    sandbox_base.mkdir(parents=True)
    provider = LocalProvider(isolation="none", base_dir=sandbox_base)
    try:
        async with stopped_at(sandbox_base, "none", "mount", "hold"):
            held = _left(sandbox_base)
            assert held[0] and held[1]  # a maker file and a directory; its tmpfs
            LocalProvider(isolation="none", base_dir=sandbox_base)  # sweeps: not a live maker's work
            report = await reap(provider)
            assert report == [] and report.unknown == ()
            assert _left(sandbox_base) == held
        assert _left(sandbox_base) == held  # killed now: nobody has removed anything yet
        preview = await reap(provider, dry_run=True)
        assert [entry.closed for entry in preview] == [False] and _left(sandbox_base) == held
        report = await reap(provider)
        assert [entry.sandbox_id for entry in report] == [held[0][0][:18]]
        assert report[0].closed and "half-made" in report[0].reason and report[0].run_id == ""
        assert _left(sandbox_base) == ([], [], [])
    finally:
        await provider.aclose()


async def test_a_maker_in_another_pid_namespace_is_left_alone_and_reported(sandbox_base: Path) -> None:
    """A maker in a PID namespace of its own, held mid-make: from here its liveness is unknown, so
    neither a new provider nor reap removes its work; reap reports it in ``unknown``."""
    sandbox_base.mkdir(parents=True)
    argv = in_own_pid_namespace([sys.executable, "-c", _CHILD, str(sandbox_base), "none", "layout", "hold"])
    provider = LocalProvider(isolation="none", base_dir=sandbox_base)
    try:
        async with await anyio.open_process(argv) as child:
            try:
                assert child.stdout is not None
                with anyio.fail_after(60):
                    assert (await child.stdout.receive()).strip() == b"layout"
                names, _, groups = _left(sandbox_base)
                [sandbox_id] = [name[:18] for name in names if name.endswith(MAKER)]
                LocalProvider(isolation="none", base_dir=sandbox_base)  # sweeps: not this one
                report = await reap(provider)
                assert report == [] and [entry.sandbox_id for entry in report.unknown] == [sandbox_id]
                assert "half-made" in report.unknown[0].reason and "PID namespace" in report.unknown[0].reason
                assert _left(sandbox_base)[0] == names and _left(sandbox_base)[2] == groups
            finally:
                child.send_signal(signal.SIGKILL)
                with anyio.CancelScope(shield=True):
                    await child.wait()
    finally:
        await provider.aclose()
        for name in sorted(os.listdir(sandbox_base), key=lambda name: name.endswith(MAKER)):  # directories first
            groups = CgroupBackend().groups_of(name[:18])  # its namespace is gone, which no one here can tell
            if not name.endswith(MAKER):
                remove_box(sandbox_base / name, False, groups)  # its maker file with it
            elif (sandbox_base / name).exists():
                os.unlink(sandbox_base / name)
                CgroupBackend.remove(groups)
    assert _left(sandbox_base) == ([], [], [])
