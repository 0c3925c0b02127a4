"""Spare sandboxes (``_spares.py``): a bwrap create takes one made ahead, of its shape only; no listing
shows a spare; aclose, interpreter exit and the next provider of a dead process remove them."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import LocalProvider, SandboxArgumentError, SandboxHandle, SandboxSpec
from sandbox_middleware.providers.local._cgroups import CgroupBackend
from tests.leftovers import sandbox_dirs, spare_dirs

pytestmark = pytest.mark.anyio


def cgroups_of(sandbox_id: str) -> list[Path]:
    """The cgroups of ``sandbox_id`` that exist, wherever this machine makes them."""
    return CgroupBackend().groups_of(sandbox_id)


async def one_spare(base: Path) -> Path:
    """The single spare of ``base``, waited for: a spare is made in the background after a create."""
    with anyio.fail_after(60):
        while len(found := spare_dirs(base)) != 1:
            await anyio.sleep(0.01)
    return found[0]


@pytest.fixture
async def local(sandbox_base: Path) -> AsyncIterator[LocalProvider]:
    provider = LocalProvider(isolation="bwrap", base_dir=sandbox_base, memory_mib=256)
    yield provider
    await provider.aclose()


async def test_a_create_takes_the_spare_of_its_shape_and_no_listing_shows_a_spare(
    local: LocalProvider, sandbox_base: Path
) -> None:
    spare = await one_spare(sandbox_base)  # made at construction, for the default limits
    assert await local.list() == []
    handle = await local.create(SandboxSpec(metadata={"task": "a"}, workdir="src"))
    assert spare.name.startswith(handle.sandbox_id + "-")  # that very sandbox, now a sandbox
    assert not (spare / "spare.json").exists()
    assert [(listing.handle.sandbox_id, listing.metadata) for listing in await local.list()] == [
        (handle.sandbox_id, {"task": "a"})
    ]
    result = await local.exec(handle, "pwd; ls -A ..; echo $HOME")
    assert result.stdout == "/workspace/src\nsrc\n/workspace\n", result.stderr  # made for this spec, empty
    following = await one_spare(sandbox_base)  # the next one, made behind it
    assert following != spare and len(sandbox_dirs(sandbox_base)) == 1
    await local.close(handle)
    assert not spare.exists() and cgroups_of(handle.sandbox_id) == []


async def test_a_create_of_another_shape_makes_its_own_and_the_spare_follows_it(
    local: LocalProvider, sandbox_base: Path
) -> None:
    old = await one_spare(sandbox_base)
    bigger = await local.create(SandboxSpec(resources={"memory_mib": 512}))
    assert not old.name.startswith(bigger.sandbox_id)
    memory = [group for group in cgroups_of(bigger.sandbox_id) if "memory" in group.parts]
    assert [(group / "memory.limit_in_bytes").read_text() for group in memory] == [f"{512 << 20}\n"]
    new = await one_spare(sandbox_base)  # the old shape's spare is removed, one of the new shape made
    assert not old.exists() and cgroups_of(old.name[:18]) == []
    again = await local.create(SandboxSpec(resources={"memory_mib": 512}))
    assert new.name.startswith(again.sandbox_id + "-")
    for handle in (bigger, again):
        await local.close(handle)


async def test_a_spare_whose_starter_died_is_not_handed_out(local: LocalProvider, sandbox_base: Path) -> None:
    spare = await one_spare(sandbox_base)
    ready = local._spares._ready  # type: ignore[union-attr]
    assert len(ready) == 1 and ready[0].starter is not None
    ready[0].starter.kill()  # as the OOM killer would
    handle = await local.create(SandboxSpec())
    assert not spare.name.startswith(handle.sandbox_id)
    assert (await local.exec(handle, "echo ok")).stdout == "ok\n"
    await one_spare(sandbox_base)
    assert not spare.exists()
    await local.close(handle)


async def test_aclose_removes_the_spare_and_prestart_false_makes_none(sandbox_base: Path) -> None:
    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base)
    spare = await one_spare(sandbox_base)
    await local.aclose()
    assert list(sandbox_base.iterdir()) == [] and cgroups_of(spare.name[:18]) == []
    plain = LocalProvider(isolation="bwrap", base_dir=sandbox_base, prestart=False)
    handle = await plain.create(SandboxSpec())
    await anyio.sleep(0.2)
    assert spare_dirs(sandbox_base) == []
    await plain.close(handle)
    await plain.aclose()


_EXITS = """
import anyio, sys
from sandbox_middleware import LocalProvider, SandboxArgumentError, SandboxHandle, SandboxSpec
from sandbox_middleware.providers.local._cgroups import CgroupBackend

async def main():
    local = LocalProvider(isolation="bwrap", base_dir=sys.argv[1])
    handle = await local.create(SandboxSpec())
    await local.close(handle)  # a spare is made behind it; nobody calls aclose
    print("created", flush=True)
    if sys.argv[2] == "hang":
        await anyio.sleep(600)

anyio.run(main)
"""


@pytest.mark.requires_bwrap  # the first provider runs in a subprocess
async def test_a_spare_is_removed_at_exit_and_a_killed_process_spare_by_the_next_provider(
    sandbox_base: Path,
) -> None:
    sandbox_base.mkdir(parents=True)
    exited = await anyio.run_process([sys.executable, "-c", _EXITS, str(sandbox_base), "exit"], check=False)
    assert exited.returncode == 0 and exited.stdout == b"created\n", exited.stderr.decode()
    assert list(sandbox_base.iterdir()) == []  # atexit removed the spare it made meanwhile

    async with await anyio.open_process([sys.executable, "-c", _EXITS, str(sandbox_base), "hang"]) as killed:
        assert killed.stdout is not None
        said = b""
        while not said.endswith(b"\n"):
            said += await killed.stdout.receive()
        assert said == b"created\n"
        orphan = await one_spare(sandbox_base)
        killed.send_signal(signal.SIGKILL)
        await killed.wait()
    assert orphan.exists() and cgroups_of(orphan.name[:18])  # left behind: nothing ran its exit

    alive = LocalProvider(isolation="bwrap", base_dir=sandbox_base)  # sweeps it before making its own
    assert not orphan.exists() and cgroups_of(orphan.name[:18]) == []
    mine = await one_spare(sandbox_base)
    LocalProvider(isolation="bwrap", base_dir=sandbox_base, prestart=False)  # sweeps too; not this live one
    assert spare_dirs(sandbox_base) == [mine]
    await alive.aclose()
    assert list(sandbox_base.iterdir()) == []


async def test_a_provider_dropped_without_aclose_removes_its_spare_when_collected(sandbox_base: Path) -> None:
    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    await local.close(handle)
    spare = await one_spare(sandbox_base)
    del local
    # The maker thread may still be finishing the spare (its directory is there before its make returns)
    # and hold a reference to the provider: once it drops it, the provider (in reference cycles of its
    # own) goes at the next collection, its finalizer with it, and the spare after.
    with anyio.fail_after(30):
        while spare.exists() or cgroups_of(spare.name[:18]):
            gc.collect()
            await anyio.sleep(0.02)


async def test_spares_keeps_that_many_made_ahead_and_a_group_of_creates_takes_them(sandbox_base: Path) -> None:
    """``spares=3``: three of the last shape are made ahead (one at a time, behind the creates), and three
    creates at once take them all; the next are made behind them."""
    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base, memory_mib=256, spares=3)
    try:
        handle = await local.create(SandboxSpec())
        with anyio.fail_after(60):
            while len(spare_dirs(sandbox_base)) != 3:
                await anyio.sleep(0.01)
        spares = {path.name[:18] for path in spare_dirs(sandbox_base)}
        handles: list[SandboxHandle] = []
        async with anyio.create_task_group() as group:
            for _ in range(3):

                async def one() -> None:
                    handles.append(await local.create(SandboxSpec()))

                group.start_soon(one)
        assert {made.sandbox_id for made in handles} == spares
        with anyio.fail_after(60):
            while len(spare_dirs(sandbox_base)) != 3:
                await anyio.sleep(0.01)
        for made in [handle, *handles]:
            await local.close(made)
    finally:
        await local.aclose()
    assert sandbox_dirs(sandbox_base) == []


@pytest.mark.parametrize("spares", [0, 65, 1.5])
def test_spares_out_of_bounds_is_refused(spares: object, sandbox_base: Path) -> None:
    with pytest.raises(SandboxArgumentError, match="spares"):
        LocalProvider(isolation="bwrap", base_dir=sandbox_base, spares=spares)  # type: ignore[arg-type]
