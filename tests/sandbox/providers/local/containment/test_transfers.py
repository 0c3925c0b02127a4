"""File transfers against a hostile sandbox: symlink races, FIFOs, sparse files, names that are not UTF-8, and
the event loop."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import (
    LocalProvider,
    SandboxArgumentError,
    SandboxError,
    SandboxHandle,
    SandboxPathError,
    SandboxSpec,
    SandboxTransferLimitError,
)

pytestmark = pytest.mark.anyio


ATTEMPTS = 2000


async def test_symlink_swap_never_wins_a_download(provider: LocalProvider, tmp_path: Path) -> None:
    """A command swapping a file and a directory for symlinks to host paths never gets a host file out."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET")
    (tmp_path / "host-dir").mkdir()
    (tmp_path / "host-dir" / "f").write_text("HOST-SECRET")
    handle = await provider.create(SandboxSpec())
    swapper = (
        "mkdir -p d; echo inside > d/f; echo inside > f; "
        f"while true; do ln -sfn {secret} f; echo inside > f.new; mv -f f.new f; "
        f"mv d d.real; ln -sfn {tmp_path / 'host-dir'} d; rm d; mv d.real d; done"
    )
    outcomes: dict[str, int] = {}
    target = tmp_path / "out.txt"
    async with anyio.create_task_group() as group:
        group.start_soon(_run_quietly, provider, handle, swapper)
        await anyio.sleep(0.2)
        for attempt in range(ATTEMPTS):
            name = "f" if attempt % 2 else "d/f"
            try:
                await provider.download_file(handle, name, target)
            except SandboxPathError:
                outcomes["refused"] = outcomes.get("refused", 0) + 1
                continue
            except SandboxError:
                outcomes["missing"] = outcomes.get("missing", 0) + 1  # caught mid-rename
                continue
            content = target.read_text()
            assert content == "inside\n", f"attempt {attempt} read {content!r}"
            outcomes["inside"] = outcomes.get("inside", 0) + 1
        group.cancel_scope.cancel()
    assert outcomes.get("refused", 0) > 0, outcomes  # the race was really run


async def test_symlink_swap_never_wins_an_upload(provider: LocalProvider, tmp_path: Path) -> None:
    """Uploads racing a symlink swap never write a host file or into a host directory."""
    victim = tmp_path / "host-victim.txt"
    victim.write_text("untouched")
    victim_dir = tmp_path / "host-dir"
    victim_dir.mkdir()
    source = tmp_path / "payload.txt"
    source.write_text("payload")
    handle = await provider.create(SandboxSpec())
    swapper = (
        "mkdir -p d; "
        f"while true; do ln -sfn {victim} f; rm -f f; mv d d.real; ln -sfn {victim_dir} d; rm d; mv d.real d; done"
    )
    refused = 0
    async with anyio.create_task_group() as group:
        group.start_soon(_run_quietly, provider, handle, swapper)
        await anyio.sleep(0.2)
        attempt = 0
        # ATTEMPTS at least, and on until the swap has been caught once: on a loaded machine (the suite split
        # over the cores) the swapper's shell may barely have run by then
        with anyio.move_on_after(120):
            while attempt < ATTEMPTS or not refused:
                try:
                    await provider.upload_file(handle, source, "f" if attempt % 2 else "d/f")
                except SandboxPathError:
                    refused += 1
                except SandboxError:
                    pass  # caught mid-rename
                attempt += 1
        group.cancel_scope.cancel()
    assert victim.read_text() == "untouched"
    assert list(victim_dir.iterdir()) == []
    assert refused > 0


async def _run_quietly(provider: LocalProvider, handle: SandboxHandle, command: str) -> None:
    await provider.exec(handle, command, timeout_s=120)


async def test_sparse_file_download_is_refused(provider: LocalProvider, tmp_path: Path) -> None:
    """A 1 GiB sparse file is refused before anything is copied to the host."""
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "truncate -s 1G big.bin")
    with pytest.raises(SandboxTransferLimitError, match=r"'big.bin' is 1073741824 bytes, over max_transfer_bytes"):
        await provider.download_file(handle, "big.bin", tmp_path / "big.bin")
    assert not (tmp_path / "big.bin").exists()


async def test_fifo_upload_source_does_not_hang(provider: LocalProvider, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    handle = await provider.create(SandboxSpec())
    with anyio.fail_after(10), pytest.raises(SandboxError, match="not a regular file"):
        await provider.upload_file(handle, fifo, "x")


async def test_transfers_do_not_block_the_event_loop(provider: LocalProvider, tmp_path: Path) -> None:
    """A 100 MB upload and its download run off the loop: another task keeps ticking meanwhile."""
    source = tmp_path / "big.bin"
    with source.open("wb") as out:
        out.truncate(100 << 20)
    handle = await provider.create(SandboxSpec())
    for transfer in (
        lambda: provider.upload_file(handle, source, "big.bin"),
        lambda: provider.download_file(handle, "big.bin", tmp_path / "back.bin"),
    ):
        done = anyio.Event()
        ticks = 0
        async with anyio.create_task_group() as group:
            group.start_soon(_then_set, transfer, done)
            while not done.is_set():
                ticks += 1
                await anyio.lowlevel.checkpoint()
        assert ticks > 1
    assert (tmp_path / "back.bin").stat().st_size == 100 << 20


async def _then_set(call: Callable[[], Awaitable[None]], done: anyio.Event) -> None:
    await call()
    done.set()


async def test_non_utf8_names_travel_byte_for_byte(provider: LocalProvider, tmp_path: Path) -> None:
    """A file a command names in bytes that are not UTF-8 can be downloaded, uploaded next to, and used
    as cwd (as ``os.listdir`` names it, a str with surrogate escapes, or as bytes); a name the OS
    cannot hold at all is a typed error."""
    handle = await provider.create(SandboxSpec())
    made = await provider.exec(handle, "mkdir \"$(printf 'd\\376')\" && printf hi > \"$(printf 'd\\376/f\\377')\"")
    assert made.return_code == 0, made.stderr
    name = os.fsdecode(b"d\xfe/f\xff")
    await provider.download_file(handle, name, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"hi"
    await provider.download_file(handle, b"d\xfe/f\xff", tmp_path / "bytes")  # type: ignore[arg-type]
    assert (tmp_path / "bytes").read_bytes() == b"hi"
    await provider.upload_file(handle, tmp_path / "out", os.fsdecode(b"d\xfe/up\xfd"))
    listed = await provider.exec(handle, "ls | od -An -c", cwd=os.fsdecode(b"d\xfe"))
    assert listed.stdout.split() == ["f", "377", "\\n", "u", "p", "375", "\\n"]
    for call in (
        provider.download_file(handle, "\ud800", tmp_path / "x"),
        provider.exec(handle, "true", cwd="\ud800"),
        provider.create(SandboxSpec(workdir="/w\ud800")),
    ):
        with pytest.raises(SandboxArgumentError, match="cannot be encoded"):
            await call
    await provider.aclose()
