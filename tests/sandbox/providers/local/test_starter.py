"""The command starter's protocol half, run on the host: command specs, return codes, PATH lookup, plain commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox_middleware.providers.local._starter import (
    _which,
    command_status,
    decode_spec,
    direct_command,
    encode_spec,
    returncode,
)


def test_a_spec_round_trips_as_bytes() -> None:
    argv = ["bash", "-c", "echo 'a b' = \t\n$HOME", ""]
    env = {"PATH": "/usr/bin:/bin", "EMPTY": "", "WITH_EQUALS": "a=b=c", "ÜNICODE": "ß"}
    decoded_argv, decoded_env, cwd = decode_spec(encode_spec(argv, env, "/workspace/sub dir"))
    assert decoded_argv == [os.fsencode(arg) for arg in argv]
    assert decoded_env == {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    assert cwd == b"/workspace/sub dir"


@pytest.mark.parametrize(
    "data",
    [b"/\x005\x00bash\x00-c", b"/\x000\x00", b"/\x001\x00bash\x00NOEQUALS", b"/\x001\x00bash\x00=value", b"/"],
)
def test_a_malformed_spec_is_refused(data: bytes) -> None:
    with pytest.raises((ValueError, IndexError)):
        decode_spec(data)


def _status(script: str) -> int:
    process = subprocess.Popen(["sh", "-c", script])
    _, status = os.waitpid(process.pid, 0)
    process.returncode = 0  # reaped here
    return status


def test_return_codes_match_what_subprocess_reported_for_bwrap() -> None:
    """A command's exit code passes through; a signal becomes 128 + signal in the command init's exit
    code (bwrap's convention); a killed init (a timeout) is -signal, as subprocess said for bwrap."""
    assert command_status(_status("exit 3")) == 3
    assert command_status(_status("kill -9 $$")) == 128 + 9
    assert command_status(_status("kill -15 $$")) == 128 + 15
    assert returncode(_status("exit 3")) == 3
    assert returncode(_status("exit 137")) == 137
    assert returncode(_status("kill -9 $$")) == -9


def test_commands_are_looked_up_in_their_own_path(tmp_path: os.PathLike[str]) -> None:
    tool = os.path.join(tmp_path, "tool")
    with open(tool, "w") as file:
        file.write("#!/bin/sh\n")
    os.chmod(tool, 0o755)
    os.mkdir(os.path.join(tmp_path, "dir"))
    path = os.fsencode(f"/nonexistent:{os.path.join(tmp_path, 'dir')}:{tmp_path}")
    assert _which(b"tool", path) == os.fsencode(tool)
    assert _which(b"./relative/name", b"") == b"./relative/name"  # a name with a slash is taken as it is
    with pytest.raises(FileNotFoundError, match="dir not found"):
        _which(b"dir", path)  # a directory is no command


# --- which commands the command init starts itself (their results: test_plain_commands.py) ---------------


@pytest.fixture
def plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[bytes, list[bytes], Any] | None]:
    """``direct_command`` for ``bash -c COMMAND`` in ``tmp_path`` (holding ``tool``, an ELF program, and
    ``script``, a ``#!`` one), with this machine's bash as the one the init may stand in for."""
    os.symlink(shutil.which("true") or "/usr/bin/true", tmp_path / "tool")
    (tmp_path / "script").write_text("#!/bin/sh\n")
    (tmp_path / "plain-text").write_text("echo hi\n")
    (tmp_path / "script").chmod(0o755)
    (tmp_path / "plain-text").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    path = f"{tmp_path}:/usr/bin:/bin"
    bash = os.stat(_which(b"bash", path.encode()))

    def run(command: str, **env: str) -> tuple[bytes, list[bytes], Any] | None:
        environment = {b"PATH": path.encode(), b"HOME": b"/", **{k.encode(): v.encode() for k, v in env.items()}}
        return direct_command([b"bash", b"-c", command.encode()], environment, (bash.st_dev, bash.st_ino))

    return run


def test_plain_words_start_as_bash_would_exec_them(plain: Callable[..., Any], tmp_path: Path) -> None:
    program, argv, env = plain("tool  a -b --c=d ./e,f:g+h@i%j^k")
    assert program == os.fsencode(tmp_path / "tool")
    assert argv == [b"tool", b"a", b"-b", b"--c=d", b"./e,f:g+h@i%j^k"]
    assert list(env) == [b"PWD", b"HOME", b"SHLVL", b"PATH", b"_"]  # bash's table order, then _
    assert (env[b"PWD"], env[b"SHLVL"], env[b"_"]) == (os.fsencode(os.getcwd()), b"0", program)
    assert plain("./script x")[:2] == (b"./script", [b"./script", b"x"])
    assert plain("true") is not None and plain("false") is not None  # the system's, no arguments


@pytest.mark.parametrize(
    "command",
    [
        "tool $HOME", "tool 'a'", 'tool "a"', "tool a\\ b", "tool *", "tool ~", "tool a;tool", "tool | tool",
        "tool > x", "tool &", "tool # c", "tool {a,b}", "tool\ta", "tool\n", "A=1 tool", "ünïcode", "", "  ",
        "echo a", "cd /", "export A=1", "exec tool", "set -x", ". x", "source x", "ulimit -n 1", "umask 0",
        "if", "[[", "test -e x", "true --help", "false x", "pwd", "kill 1",
        "nonexistent", "./nonexistent", "./plain-text", ".", "/tmp",
    ],
)  # fmt: skip
def test_anything_else_goes_to_bash(plain: Callable[..., Any], command: str) -> None:
    assert plain(command) is None


@pytest.mark.parametrize(
    "env",
    [
        {"BASH_ENV": "x"}, {"BASH_FUNC_tool%%": "() { :; }"}, {"ENV": "x"}, {"SHELLOPTS": "xtrace"},
        {"BASHOPTS": "x"}, {"SHLVL": "3"}, {"PWD": "/"}, {"OLDPWD": "/"}, {"_": "x"}, {"IFS": ":"},
        {"POSIXLY_CORRECT": "1"}, {"EXECIGNORE": "*"}, {"PS4": "+"}, {"A-B": "x"}, {"1A": "x"}, {"LC_ALL": "xx"},
        {"PATH": "relative:/usr/bin"}, {"PATH": ":/usr/bin"},
    ],
)  # fmt: skip
def test_an_environment_bash_would_change_goes_to_bash(plain: Callable[..., Any], env: dict[str, str]) -> None:
    assert plain("tool", **env) is None


def test_another_bash_in_path_or_another_true_goes_to_bash(plain: Callable[..., Any], tmp_path: Path) -> None:
    assert plain("tool", LC_ALL="C", LANG="xx") is not None
    (tmp_path / "true").write_text("#!/bin/sh\necho custom\n")
    (tmp_path / "true").chmod(0o755)
    assert plain("true") is None  # bash runs its builtin, not this one
    os.symlink(tmp_path / "script", tmp_path / "bash")
    assert plain("tool") is None  # the bash PATH names is not the one checked
    assert direct_command([b"bash", b"-c", b"tool"], {b"PATH": os.fsencode(tmp_path)}, None) is None
    assert direct_command([b"bash", b"-c", b"tool", b"bash"], {b"PATH": os.fsencode(tmp_path)}, (0, 0)) is None
