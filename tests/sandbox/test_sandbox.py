"""The Sandbox facade: start, stop and cleanup on every failure path."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_middleware import (
    LocalProvider,
    ProviderMiddleware,
    Sandbox,
    SandboxCreateError,
    SandboxError,
    SandboxHandle,
    SandboxNotStartedError,
    SandboxSnapshotError,
    SandboxSpec,
    SandboxStatus,
    SandboxValueError,
)
from sandbox_middleware.testing import FaultInjectingProvider, InjectedFault
from tests.leftovers import sandbox_dirs
from tests.providers import PlainProvider

pytestmark = pytest.mark.anyio


class UploadFails(ProviderMiddleware):
    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        raise OSError("disk full")


async def test_lifecycle_with_local_provider(tmp_path: Path, sandbox_base: Path) -> None:
    """The spec's files (path -> contents) and the local files (path -> local path) are in place at
    start, and the temporary copies of the contents are gone; exit stops the sandbox."""
    source = tmp_path / "task.txt"
    source.write_text("task")
    local = LocalProvider(base_dir=sandbox_base)
    spec = SandboxSpec(files={"in/spec.txt": "from the spec\n"})
    temporary = set(Path(tempfile.gettempdir()).glob("sandbox-middleware-files-*"))
    async with Sandbox(local, spec, local_files={"in/task.txt": source}) as sb:
        assert (await sb.exec("cat in/spec.txt")).stdout == "from the spec\n"
        assert set(Path(tempfile.gettempdir()).glob("sandbox-middleware-files-*")) == temporary
        assert (await sb.exec("cat in/task.txt")).stdout == "task"
        await sb.upload(source, "again.txt")
        await sb.exec("cat again.txt in/task.txt > both.txt")
        await sb.download("both.txt", tmp_path / "both.txt")
        assert (tmp_path / "both.txt").read_text() == "tasktask"
        assert await sb.status() == SandboxStatus.RUNNING
        root = Path(sb.handle.raw["root"])
    assert not root.exists()
    assert not sb.started


async def test_failed_upload_closes_and_propagates() -> None:
    """A failing initial upload closes the sandbox and the upload's error propagates."""
    plain = PlainProvider()
    with pytest.raises(OSError, match="disk full"):
        async with Sandbox(UploadFails(plain), SandboxSpec(files={"a": "contents"})):
            pytest.fail("body must not run")
    assert plain.alive == set()
    assert [op for op, _ in plain.calls] == ["create", "close"]


async def test_cancellation_right_after_create_closes() -> None:
    """Cancelled between create and the upload, the sandbox is still closed."""
    plain = PlainProvider()

    class SlowUpload(ProviderMiddleware):
        async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
            await anyio.sleep_forever()

    with anyio.move_on_after(0.1) as scope:
        async with Sandbox(SlowUpload(plain), SandboxSpec(files={"a": "x"})):
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert plain.alive == set()
    assert [op for op, _ in plain.calls] == ["create", "close"]


async def test_cancellation_in_body_closes() -> None:
    """Cancelling the body still closes the sandbox, shielded from that cancellation."""
    plain = PlainProvider()
    with anyio.move_on_after(0.1):
        async with Sandbox(plain):
            await anyio.sleep_forever()
    assert plain.alive == set()


async def test_failed_close_then_retry() -> None:
    """A rejected close leaves the sandbox started; a second stop closes it; a third is a no-op."""
    plain = PlainProvider()
    sandbox = Sandbox(FaultInjectingProvider(plain, close_failures=1))
    await sandbox.start()
    with pytest.raises(InjectedFault, match="injected close failure 1/1"):
        await sandbox.stop()
    assert sandbox.started and plain.alive
    await sandbox.stop()
    assert not sandbox.started and not plain.alive
    await sandbox.stop()
    assert [op for op, _ in plain.calls].count("close") == 1


async def test_close_is_bounded_in_time() -> None:
    """A close that hangs is abandoned after close_timeout_s with TimeoutError."""

    class Hangs(ProviderMiddleware):
        async def close(self, handle: SandboxHandle) -> None:
            await anyio.sleep_forever()

    sandbox = Sandbox(Hangs(PlainProvider()), close_timeout_s=0.1)
    await sandbox.start()
    with pytest.raises(TimeoutError):
        await sandbox.stop()
    assert sandbox.started


async def test_operations_need_a_started_sandbox() -> None:
    """Using a sandbox before start raises a typed error saying what to do."""
    with pytest.raises(SandboxNotStartedError, match="call start"):
        await Sandbox(PlainProvider()).exec("true")


async def test_exec_passes_provider_keywords_and_a_bad_local_file_closes(tmp_path: Path, sandbox_base: Path) -> None:
    """The facade's exec hands provider-specific keywords on; a local file that cannot be read fails
    start with the provider's error naming it, and the sandbox is closed."""
    seen: list[object] = []

    class Stdin(ProviderMiddleware):
        async def exec(self, handle: SandboxHandle, command: str, *, stdin: bytes | None = None, **kw: Any) -> Any:
            seen.append(stdin)
            return await super().exec(handle, command, **kw)

    plain = PlainProvider()
    async with Sandbox(Stdin(plain)) as sandbox:
        await sandbox.exec("cat", stdin=b"input")
    assert seen == [b"input"]

    local = LocalProvider(base_dir=sandbox_base)
    with pytest.raises(SandboxError, match=r"missing\.txt"):
        await Sandbox(local, local_files={"in.txt": tmp_path / "missing.txt"}).start()
    assert sandbox_dirs(sandbox_base) == []
    await local.aclose()


async def test_a_fork_whose_snapshot_cannot_be_deleted_closes_its_forks() -> None:
    """The delete after the forks are made fails: the forks are closed before the error propagates (they
    were left started, in no caller's hands), the parent is untouched, and the snapshot stays held."""
    provider = FaultInjectingProvider(failure_rates={"delete_snapshot": 1.0})
    async with Sandbox(provider) as parent:
        with pytest.raises(InjectedFault):
            await parent.fork(3)
        assert provider.alive == {parent.handle.sandbox_id}
        assert provider.calls["create"] == 4 and provider.calls["close"] == 3
    assert len(provider.snapshots) == 1  # its delete failed again: what the ledger reports, and reap removes


class ThirdCreateFails(ProviderMiddleware):
    """The third create fails with a create error; the others pass through."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.creates = 0

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        self.creates += 1
        if self.creates == 3:
            raise SandboxCreateError("no room for the third")
        return await self.inner.create(spec, **extensions)


async def test_a_fork_whose_create_fails_raises_that_error_and_closes_the_others() -> None:
    """One create of four fails: its own error comes out (not an ExceptionGroup, so ``except
    SandboxCreateError`` catches it), every fork made is closed and the snapshot deleted."""
    memory = FaultInjectingProvider()
    provider = ThirdCreateFails(memory)
    async with Sandbox(provider) as parent:
        with pytest.raises(SandboxCreateError, match="no room for the third"):
            await parent.fork(3)
        assert memory.alive == {parent.handle.sandbox_id}
        assert memory.snapshots == set()


async def test_forks_entered_are_made_from_the_parents_files_and_closed_on_exit(tmp_path: Path) -> None:
    """``async with parent.fork(2)``: each fork starts with the parent's files, writes its own, and is
    closed on the way out; the snapshot is gone once they are made, unless kept."""
    provider = FaultInjectingProvider()
    source = tmp_path / "state.txt"
    source.write_text("prepared")
    async with Sandbox(provider, local_files={"/workspace/state.txt": source}) as parent:
        async with parent.fork(2) as forks:
            assert provider.alive == {parent.handle.sandbox_id, *(fork.handle.sandbox_id for fork in forks)}
            assert provider.snapshots == set()
            for index, fork in enumerate(forks):
                await fork.download("/workspace/state.txt", tmp_path / f"fork-{index}.txt")
                assert (tmp_path / f"fork-{index}.txt").read_text() == "prepared"
        assert provider.alive == {parent.handle.sandbox_id}
        kept = parent.fork(1, keep_snapshot=True)
        (fork,) = await kept
        assert kept.snapshot is not None and provider.snapshots == {kept.snapshot.snapshot_id}
        await fork.stop()
        await provider.delete_snapshot(kept.snapshot)


@pytest.mark.parametrize("n", [0, -1, True, 1.5])
async def test_fork_needs_a_positive_count(n: Any) -> None:
    async with Sandbox(FaultInjectingProvider()) as parent:
        with pytest.raises(SandboxValueError, match=r"n must be an int >= 1"):
            parent.fork(n)


async def test_a_provider_without_snapshots_cannot_fork() -> None:
    async with Sandbox(PlainProvider()) as parent:
        with pytest.raises(SandboxSnapshotError, match=r"takes no snapshots \(no SupportsSandboxSnapshot\)"):
            await parent.fork(2)
