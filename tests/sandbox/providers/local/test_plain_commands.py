"""Plain commands under bwrap: the command init starts them as ``bash -c`` would exec them, with the same result.

Each command runs twice in one sandbox: through ``LocalProvider.exec`` (``bash -c COMMAND``, which the
init starts itself when the command is plain) and through the same starter as ``bash -c COMMAND bash``
(bash itself, always: the fast path takes exactly ``bash -c COMMAND``; the extra ``bash`` is ``$0``,
which is ``bash`` either way). Stdout, stderr, the return code and the error type must be equal.
Which commands take the fast path is checked on the host, in ``test_starter.py``.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from sandbox_middleware import LocalProvider, SandboxExecResult, SandboxHandle, SandboxSpec
from sandbox_middleware.providers.local._commands import run_command
from sandbox_middleware.providers.local._supervisor import plain_bash

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed")]

# Names that share bash's variable buckets with PWD (SANDBOX_401, SANDBOX_508), SHLVL (SANDBOX_1794),
# PATH (SANDBOX_3509) and HOME (SANDBOX_2599): the environment's order shows bash's table.
_SPEC_ENV = {"SANDBOX_401": "a", "SANDBOX_3509": "b", "SANDBOX_1794": "c", "SANDBOX_2599": "d"}
_SETUP = r"""
mkdir -p bin dir sub
printf '#!/bin/sh\necho "pid $$ ppid $PPID $0 $*"; grep -E "^Sig(Blk|Ign)" /proc/self/status; cat\n' > bin/tool
printf '#!/bin/sh\nkill -TERM $$\n' > bin/selfkill
printf '#!/bin/sh\necho custom true\n' > bin/true
printf '#!/bin/sh\necho fake bash "$1" "$2"\n' > dir/bash
printf 'echo "read by bash as pid $$"\n' > noshebang
printf '#!/nonexistent/interpreter\n' > badinterpreter
printf '#!/bin/sh\necho never\n' > notexecutable
chmod +x bin/tool bin/selfkill bin/true dir/bash noshebang badinterpreter
"""
_WITH_BIN = {"PATH": "/workspace/bin:/usr/bin:/bin"}
CASES: list[tuple[str, dict[str, str] | None, str | None]] = [
    ("env", None, None),
    ("env -0", {"SANDBOX_508": "e", "LANG": "C", "LC_ALL": "C", "TERM": "dumb"}, None),
    ("env", None, "sub"),
    ("/usr/bin/env", None, None),
    ("/usr/bin/pwd", None, "sub"),
    ("pwd", None, "sub"),
    ("true", None, None),
    ("false", None, None),
    ("true", _WITH_BIN, None),  # bash's builtin, not bin/true
    ("true --help", None, None),
    ("ls -la dir", None, None),
    ("cat", None, None),  # stdin is /dev/null
    ("tool a b", _WITH_BIN, None),
    ("./bin/tool x", None, None),
    ("bin/tool", None, None),
    ("tool", None, None),  # not in the default PATH: command not found
    ("selfkill", _WITH_BIN, None),  # killed by SIGTERM: 143
    ("nonexistent-command", None, None),
    ("./nonexistent", None, None),
    ("./notexecutable", None, None),  # Permission denied: 126
    ("./dir", None, None),  # Is a directory: 126
    ("./noshebang", None, None),  # bash reads it as a script, as its PID 2
    ("./badinterpreter", None, None),  # bad interpreter: 126
    ("env", {"PATH": "/workspace/dir:/usr/bin:/bin"}, None),  # another bash: that one runs
    ("env", {"PATH": "relative:/usr/bin"}, None),
    ("env", {"BASH_ENV": "/workspace/noshebang"}, None),  # bash reads it first
    ("env", {"SHLVL": "4", "PWD": "/tmp", "OLDPWD": "/", "_": "x", "RANDOM": "1"}, None),
    ("env", {"SHELLOPTS": "xtrace"}, None),
    ("env", {"LC_ALL": "xx_YY.UTF-8"}, None),  # bash warns that it cannot set the locale
    ("ls   -d    /usr ", None, None),
    ("echo plain", None, None),
    ("cd dir", None, None),
    ("A=1 env", None, None),
    ("env >/dev/null; env", None, None),
    ("printenv HOME", {"HOME": "/workspace/sub/"}, None),
]


@pytest.fixture
async def sandbox(sandbox_base: Path) -> AsyncIterator[tuple[LocalProvider, SandboxHandle]]:
    local = LocalProvider(isolation="bwrap", base_dir=sandbox_base, prestart=False)
    try:
        handle = await local.create(SandboxSpec(env=_SPEC_ENV))
        setup = await local.exec(handle, _SETUP)
        assert setup.return_code == 0, setup.stderr
        yield local, handle
    finally:
        await local.aclose()


async def _through_bash(
    local: LocalProvider, handle: SandboxHandle, command: str, env: dict[str, str] | None, cwd: str | None, **kw: Any
) -> SandboxExecResult:
    """``command`` as ``exec`` runs it, but through bash always: ``bash -c COMMAND bash``."""
    box = local._box(handle)
    starter = box.starter
    assert starter is not None
    parts = box.cwd if cwd is None else (*box.cwd, cwd)
    child_env = {**local._base_env(box), **box.env, **(env or {})}
    argv = ["bash", "-c", command, "bash"]
    start = partial(starter.run, argv, child_env, str(box.view_root.joinpath(*parts)))
    return await run_command(handle, box, start, kw.get("deadline"), 1 << 20)


def test_this_machine_has_a_bash_the_starter_may_stand_in_for() -> None:
    """Otherwise the comparisons below would compare bash with itself."""
    assert plain_bash() != "-"


@pytest.mark.parametrize(("command", "env", "cwd"), CASES)
async def test_a_command_gives_what_bash_gives(
    sandbox: tuple[LocalProvider, SandboxHandle], command: str, env: dict[str, str] | None, cwd: str | None
) -> None:
    local, handle = sandbox
    cwd_path = None if cwd is None else f"/workspace/{cwd}"
    direct = await local.exec(handle, command, env=env, cwd=cwd_path)
    shell = await _through_bash(local, handle, command, env, cwd)
    assert (direct.stdout, direct.stderr, direct.return_code, direct.error_type) == (
        shell.stdout,
        shell.stderr,
        shell.return_code,
        shell.error_type,
    )


async def test_the_results_are_those_bash_documents(sandbox: tuple[LocalProvider, SandboxHandle]) -> None:
    """The comparisons above compare something: codes, messages, the environment bash exports."""
    local, handle = sandbox
    env = await local.exec(handle, "env")
    names = [line.split("=", 1)[0] for line in env.stdout.splitlines()]
    assert names == [
        "PWD", "SANDBOX_401", "SANDBOX_2599", "HOME", "LANG", "SHLVL", "SANDBOX_1794", "SANDBOX_3509", "PATH", "_",
    ]  # fmt: skip
    assert "SHLVL=0\n" in env.stdout and env.stdout.endswith("_=/usr/bin/env\n")
    tool = await local.exec(handle, "tool a", env=_WITH_BIN)
    assert tool.stdout.startswith("pid 2 ppid 1 /workspace/bin/tool a\n") and tool.return_code == 0
    assert (await local.exec(handle, "selfkill", env=_WITH_BIN)).return_code == 128 + 15
    missing = await local.exec(handle, "nonexistent-command")
    assert (missing.return_code, missing.stderr) == (127, "bash: line 1: nonexistent-command: command not found\n")
    assert (await local.exec(handle, "./notexecutable")).return_code == 126
    assert (await local.exec(handle, "true", env=_WITH_BIN)).stdout == ""
    assert (await local.exec(handle, "env", env={"PATH": "/workspace/dir:/usr/bin"})).stdout == "fake bash -c env\n"
    assert (await local.exec(handle, "./noshebang")).stdout == "read by bash as pid 2\n"


async def test_a_timeout_kills_a_direct_command_as_it_killed_bash(
    sandbox: tuple[LocalProvider, SandboxHandle],
) -> None:
    local, handle = sandbox
    direct = await local.exec(handle, "sleep 5", timeout_s=0.3)
    shell = await _through_bash(local, handle, "sleep 5", None, None, deadline=0.3)
    assert (direct.return_code, direct.error_type) == (shell.return_code, shell.error_type) == (-9, "timeout")
