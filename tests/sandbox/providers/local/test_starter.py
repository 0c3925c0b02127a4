"""The command starter's protocol half, run on the host: command specs, return codes, PATH lookup."""

from __future__ import annotations

import os
import subprocess

import pytest

from sandbox_middleware.providers.local._starter import _which, command_status, decode_spec, encode_spec, returncode


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
