"""What a command inherits from the host (environment, stdin), and what it could pass to the host's helpers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import LocalProvider, SandboxSpec

from ._support import bwrap_only

pytestmark = pytest.mark.anyio


async def test_clean_environment(provider: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command sees the fixed base, then spec.env, then the call's env: nothing of the host's."""
    monkeypatch.setenv("TRAINER_API_KEY", "sk-very-secret")
    handle = await provider.create(SandboxSpec(env={"A": "spec", "B": "spec"}))
    result = await provider.exec(handle, "env -0", env={"B": "call"})
    env = dict(item.split("=", 1) for item in result.stdout.split("\0") if item)
    assert "sk-very-secret" not in result.stdout
    assert env["A"] == "spec" and env["B"] == "call"
    assert env["LANG"] == "C.UTF-8"
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    home = "/workspace" if provider.isolation == "bwrap" else handle.raw["root"]
    assert env["HOME"] == home
    expected = {"A", "B", "LANG", "PATH", "HOME", "PWD", "SHLVL", "_"}
    assert set(env) - {"TMPDIR"} == expected


async def test_pass_env_is_an_allow_list(
    make: Callable[..., LocalProvider],
    isolation: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sandbox_base: Path,
) -> None:
    """Only host variables named in pass_env reach a command."""
    monkeypatch.setenv("WANTED", "yes")
    monkeypatch.setenv("UNWANTED", "no")
    local = make(isolation=isolation, base_dir=sandbox_base, pass_env=["WANTED"])
    handle = await local.create(SandboxSpec())
    assert (await local.exec(handle, 'echo "$WANTED/$UNWANTED"')).stdout == "yes/\n"
    await local.aclose()


async def test_stdin_is_empty(provider: LocalProvider) -> None:
    """A command reading stdin gets end of file at once, never the trainer's stdin."""
    handle = await provider.create(SandboxSpec())
    with anyio.fail_after(20):
        result = await provider.exec(handle, "cat; readlink /proc/self/fd/0 || true; echo done")
    assert result.stdout.startswith("/dev/null") or result.stdout.endswith("done\n")
    assert result.stdout.endswith("done\n")
    assert result.stdout.splitlines()[0] == "/dev/null"


@bwrap_only
async def test_command_env_never_reaches_host_helpers(
    make: Callable[..., LocalProvider], sandbox_base: Path, tmp_path: Path
) -> None:
    """LD_PRELOAD and the like in spec.env or the call's env apply inside the sandbox only, never to
    the host-side processes that set it up (sh, setpriv, bwrap)."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(env={"LD_PRELOAD": "/nonexistent/spec.so"}))
    result = await local.exec(handle, 'echo "$LD_PRELOAD"', env={"LD_LIBRARY_PATH": "/workspace"})
    assert result.return_code == 0
    assert result.stdout == "/nonexistent/spec.so\n"
    # a host helper given that LD_PRELOAD would print the loader's complaint before the command ran
    assert "cannot be preloaded" in result.stderr  # bash inside loads it: the env is the command's own
    assert result.stderr.count("cannot be preloaded") == 1
