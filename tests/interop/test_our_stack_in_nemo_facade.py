"""Our stacked LocalProvider driven by NeMo Gym's own facades, ``AsyncSandbox`` and the sync ``Sandbox``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.sandbox.api import AsyncSandbox  # noqa: E402
from nemo_gym.sandbox.api import Sandbox as NemoSandbox  # noqa: E402
from nemo_gym.sandbox.providers import SandboxCreateError as NemoCreateError  # noqa: E402
from nemo_gym.sandbox.providers import SandboxEndpoint as NemoEndpoint  # noqa: E402
from nemo_gym.sandbox.providers import SandboxSpec as NemoSpec  # noqa: E402
from nemo_gym.sandbox.providers import SandboxStatus as NemoStatus  # noqa: E402

from sandbox_middleware import (  # noqa: E402
    LocalProvider,
    Sandbox,
    SandboxError,
    SandboxSpec,
)

from ..providers import recommended_stack  # noqa: E402

pytestmark = pytest.mark.anyio

PORT = 8080
# (isolation, workdir): NeMo Gym's usual absolute /workspace under both isolations, and no workdir.
SETUPS = [("none", None), ("none", "/workspace"), ("bwrap", "/workspace")]


def our_stack(base_dir: Path, isolation: Any = "none", **retry: Any) -> Any:
    return recommended_stack(LocalProvider(isolation=isolation, base_dir=base_dir), **retry)


async def check_endpoint(sandbox: Any, isolation: str) -> Any:
    """A declared port resolves to NeMo Gym's SandboxEndpoint; under bwrap (no network) to a clear error."""
    if isolation == "bwrap":
        with pytest.raises(SandboxError, match="no network"):
            await sandbox.endpoint(PORT)
        return None
    endpoint = await sandbox.endpoint(PORT)
    assert isinstance(endpoint, NemoEndpoint) and endpoint.endpoint == f"http://127.0.0.1:{PORT}"
    return endpoint


@pytest.mark.parametrize(("isolation", "workdir"), SETUPS)
async def test_async_sandbox_drives_our_stack(
    tmp_path: Path, isolation: str, workdir: str | None, sandbox_base: Path
) -> None:
    """Start (writing the spec's files), exec, upload, download, status, endpoint, serialize, connect
    (NeMo Gym adds ``workdir`` and ``ports`` to the provider's descriptor), disconnect and stop."""
    provider = our_stack(sandbox_base, isolation)
    spec = SandboxSpec(workdir=workdir, ports=(PORT,), files={"task/in.txt": "two words\n"}, resources={"cpu": 1})
    (tmp_path / "local.txt").write_text("local\n")
    async with AsyncSandbox(provider, spec, owns_provider=False) as sandbox:
        await sandbox.start()
        assert (await sandbox.exec("wc -w < task/in.txt")).stdout == "2\n"
        await sandbox.upload(tmp_path / "local.txt", "task/local.txt")
        result = await sandbox.exec("cat task/local.txt task/in.txt > both.txt && echo $?")
        assert (result.return_code, result.stdout) == (0, "0\n")
        await sandbox.download("both.txt", tmp_path / "both.txt")
        assert (tmp_path / "both.txt").read_text() == "local\ntwo words\n"
        assert await sandbox.status() == NemoStatus.RUNNING
        endpoint = await check_endpoint(sandbox, isolation)

        descriptor = await sandbox.serialize()
        borrowed = await AsyncSandbox.connect(descriptor, provider=provider, owns_provider=False)
        assert (await borrowed.exec("cat both.txt")).stdout == "local\ntwo words\n"
        assert await check_endpoint(borrowed, isolation) == endpoint
        await borrowed.disconnect()
        assert await sandbox.status() == NemoStatus.RUNNING
    assert await sandbox.status() == NemoStatus.STOPPED
    assert provider.inner.inner.held() == []
    await provider.aclose()
    assert list(sandbox_base.iterdir()) == []


@pytest.mark.parametrize(("isolation", "workdir"), SETUPS)
def test_sync_sandbox_drives_our_stack(tmp_path: Path, isolation: str, workdir: str | None, sandbox_base: Path) -> None:
    """NeMo Gym's synchronous facade runs our stack on its own event-loop thread."""
    provider = our_stack(sandbox_base, isolation)
    spec = SandboxSpec(workdir=workdir, ports=(PORT,), files={"in.txt": "sync\n"})
    (tmp_path / "up.txt").write_text("up\n")
    with NemoSandbox(provider, spec) as sandbox:
        sandbox.start()
        assert sandbox.exec("cat in.txt").stdout == "sync\n"
        sandbox.upload(tmp_path / "up.txt", "up.txt")
        sandbox.exec("cat up.txt in.txt > out.txt")
        sandbox.download("out.txt", tmp_path / "out.txt")
        assert (tmp_path / "out.txt").read_text() == "up\nsync\n"
        assert sandbox.status() == NemoStatus.RUNNING
        if isolation == "none":
            assert sandbox.endpoint(PORT).endpoint == f"http://127.0.0.1:{PORT}"
    assert sandbox.status() == NemoStatus.STOPPED
    assert list(sandbox_base.iterdir()) == []


async def test_nemo_facade_catches_our_create_failure_as_its_own(tmp_path: Path, sandbox_base: Path) -> None:
    """``except SandboxCreateError`` written against NeMo Gym catches our provider's create failure."""
    provider = our_stack(sandbox_base, attempts=1)
    sandbox_base.rmdir()  # the base_dir turns into a file: the next create cannot make its directory
    sandbox_base.write_text("not a directory")
    sandbox = AsyncSandbox(provider, SandboxSpec(), owns_provider=True)
    with pytest.raises(NemoCreateError, match="cannot create a sandbox"):
        await sandbox.start()


async def test_our_facade_writes_a_nemo_spec_files_as_contents(tmp_path: Path, sandbox_base: Path) -> None:
    """A NeMo Gym spec given to our facade means what it means to NeMo Gym: path -> contents."""
    provider = our_stack(sandbox_base)
    async with Sandbox(provider, NemoSpec(files={"notes/a.txt": "contents, not a path"})) as sandbox:  # type: ignore[arg-type]
        assert (await sandbox.exec("cat notes/a.txt")).stdout == "contents, not a path"
    await provider.aclose()
