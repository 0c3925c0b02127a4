"""What another process can make a provider trust: connect descriptors, listed and planted directories, base_dir."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import LocalProvider, OwnershipMiddleware, SandboxArgumentError, SandboxError, SandboxSpec, reap

pytestmark = pytest.mark.anyio


async def test_forged_descriptor_is_refused_and_deletes_nothing(
    make: Callable[..., LocalProvider], provider: LocalProvider, tmp_path: Path, sandbox_base: Path
) -> None:
    """A descriptor pointing at a host directory, or altered, or signed with another key, is refused."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    handle = await provider.create(SandboxSpec())
    genuine = await provider.serialize_handle(handle)
    forged = {**genuine, "root": str(victim)}
    for descriptor in (forged, {k: v for k, v in genuine.items() if k != "mac"}, {**genuine, "mac": "0" * 64}):
        with pytest.raises(SandboxError, match=r"signature|serialize_handle"):
            await provider.connect(descriptor)
    other = make(isolation=provider.isolation, base_dir=sandbox_base)
    with pytest.raises(SandboxError, match="signature does not match"):
        await other.connect(genuine)
    assert (victim / "keep.txt").read_text() == "keep"
    again = await provider.connect(genuine)
    assert (await provider.exec(again, "echo ok")).stdout == "ok\n"


async def test_descriptor_outside_base_dir_is_refused(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """A validly signed descriptor is still refused by a provider of another base_dir."""
    key = b"k" * 32
    first = make(base_dir=sandbox_base / "a", connect_key=key)
    second = make(base_dir=sandbox_base / "b", connect_key=key)
    handle = await first.create(SandboxSpec())
    with pytest.raises(SandboxError, match="not in this provider's base_dir"):
        await second.connect(await first.serialize_handle(handle))
    assert Path(handle.raw["root"]).is_dir()
    await first.aclose()


async def test_descriptor_with_odd_mac_or_nesting_is_a_sandbox_error(provider: LocalProvider) -> None:
    handle = await provider.create(SandboxSpec())
    genuine = await provider.serialize_handle(handle)
    nested: dict[str, Any] = {}
    for _ in range(100_000):
        nested = {"x": nested}
    for descriptor in ({**genuine, "mac": "é" * 64}, {**genuine, "env": nested}, {"mac": "0" * 64}):
        with pytest.raises(SandboxError):
            await provider.connect(descriptor)


async def test_listing_takes_nothing_over(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """Another provider's list(), a dry-run reap and its aclose() leave a live owner's sandboxes running."""
    owner = make(isolation="none", base_dir=sandbox_base)
    owned = await OwnershipMiddleware(owner, run_id="live").create(SandboxSpec())
    plain = await owner.create(SandboxSpec())
    other = make(isolation="none", base_dir=sandbox_base)
    assert len(await other.list()) == 2
    assert await reap(other, dry_run=True) == []
    await other.aclose()
    for handle in (owned, plain):
        assert (await owner.exec(handle, "echo alive")).stdout == "alive\n"


async def test_planted_directories_are_ignored(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """Entries in base_dir that are not ours (another owner, a symlink, a FIFO or deep JSON as the
    record, a second copy of a live id) are neither listed nor reaped."""
    local = make(isolation="none", base_dir=sandbox_base)
    live = await OwnershipMiddleware(local, run_id="r").create(SandboxSpec())
    record = {
        "metadata": {
            "sandbox_middleware.run_id": "r",
            "sandbox_middleware.owner.host": "h",
            "sandbox_middleware.owner.pid": "1",
            "sandbox_middleware.owner.started": "x",
        }
    }
    copy = sandbox_base / f"{live.sandbox_id}-planted"  # a second directory claiming the live id
    copy.mkdir(mode=0o711)
    (copy / "meta.json").write_text(json.dumps(record))
    (copy / "meta.json").chmod(0o600)
    fifo = sandbox_base / "local-0000000000aa-fifo"
    fifo.mkdir(mode=0o711)
    os.mkfifo(fifo / "meta.json", 0o600)
    deep = sandbox_base / "local-0000000000bb-deep"
    deep.mkdir(mode=0o711)
    (deep / "meta.json").write_text("[" * 100_000)
    (deep / "meta.json").chmod(0o600)
    foreign = sandbox_base / "local-0000000000cc-foreign"
    foreign.mkdir(mode=0o711)
    (foreign / "meta.json").write_text(json.dumps(record))
    os.chown(foreign, 12345, 12345)
    with anyio.fail_after(20):
        assert await local.list() == []  # the live one is hidden by its planted twin, the rest are not ours
        assert await reap(local, run_id="r", force=True) == []
    assert (await local.exec(live, "echo alive")).stdout == "alive\n"
    for planted in (copy, fifo, deep, foreign):
        shutil.rmtree(planted)


def test_base_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(SandboxArgumentError, match="no one else can write"):
        LocalProvider(isolation="none", base_dir=shared)
