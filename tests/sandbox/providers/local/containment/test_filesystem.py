"""The view of the host: its files, other sandboxes, the sandbox's own directory, mount and workdir, and base_dir."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_middleware import LocalProvider, SandboxArgumentError, SandboxPathError, SandboxSpec

from ._support import as_root, bwrap_only

pytestmark = pytest.mark.anyio


@bwrap_only
async def test_host_files_are_out_of_view(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """/etc/shadow, /root, /home, /run and the host's base_dir do not exist for a command."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    for path in ("/etc/shadow", "/root", "/home", "/run", "/var", "/sys", str(tmp_path)):
        result = await local.exec(handle, f"ls -d {path} || cat {path}")
        assert result.return_code != 0, path
        assert "No such file or directory" in result.stderr, path
    listing = await local.exec(handle, "ls / /etc")
    top = set(listing.stdout.split("\n\n")[0].split()[1:])
    assert top <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr", "workspace"}
    await local.aclose()


@bwrap_only
async def test_other_sandboxes_are_out_of_reach(make: Callable[..., LocalProvider], outside_tmp: Path) -> None:
    """With base_dir outside /tmp, one sandbox can neither read nor list another's files."""
    local = make(isolation="bwrap", base_dir=outside_tmp)
    first, second = await local.create(SandboxSpec()), await local.create(SandboxSpec())
    await local.exec(first, "echo secret > mine.txt")
    secret = Path(first.raw["root"]) / "mine.txt"
    assert secret.read_text() == "secret\n"
    attack = await local.exec(second, f"cat {secret}; ls {outside_tmp}; ls /workspace/..")
    assert "secret" not in attack.stdout
    assert first.sandbox_id not in attack.stdout
    await local.aclose()


@as_root
async def test_layout_gives_the_sandbox_uid_nothing_of_ours(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """The sandbox directory and its record are root's; box, tmp and shm are the sandbox uid's, 0700;
    nothing is reachable for other users, and the mount is nosuid."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec(env={"TOKEN": "secret"}))
    outer = Path(handle.raw["root"]).parent
    uid = local._boxes[handle.sandbox_id].uid
    assert (outer.stat().st_uid, oct(outer.stat().st_mode & 0o777)) == (0, "0o711")
    record = (outer / "meta.json").stat()
    assert (record.st_uid, oct(record.st_mode & 0o777)) == (0, "0o600")
    for name in ("box", "tmp", "shm"):
        info = (outer / name).stat()
        assert (info.st_uid, oct(info.st_mode & 0o777)) == (uid, "0o700"), name
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {outer} " in line]
    assert mounts and "nosuid" in mounts[0] and "nodev" in mounts[0]
    unbounded = make(isolation="bwrap", base_dir=sandbox_base, disk_gib=None)
    handle = await unbounded.create(SandboxSpec())
    outer = Path(handle.raw["root"]).parent
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {outer} " in line]
    assert mounts and "nosuid" in mounts[0]


async def test_absolute_workdir(provider: LocalProvider, tmp_path: Path) -> None:
    """An absolute workdir: under bwrap the sandbox is seen there; without isolation it maps onto the sandbox."""
    handle = await provider.create(SandboxSpec(workdir="/workspace/project"))
    source = tmp_path / "in.txt"
    source.write_text("data")
    await provider.upload_file(handle, source, "/workspace/project/in.txt")
    result = await provider.exec(handle, 'cat in.txt; echo; echo "$HOME"; pwd')
    lines = result.stdout.splitlines()
    assert lines[0] == "data"
    if provider.isolation == "bwrap":
        assert lines[1:] == ["/workspace/project", "/workspace/project"]
    else:
        assert lines[1:] == [handle.raw["root"], handle.raw["root"]]
    assert (Path(handle.raw["root"]) / "in.txt").read_text() == "data"
    await provider.download_file(handle, "/workspace/project/in.txt", tmp_path / "back.txt")
    assert (tmp_path / "back.txt").read_text() == "data"
    with pytest.raises(SandboxPathError, match="outside the sandbox"):
        await provider.upload_file(handle, source, "/etc/in.txt")


@pytest.mark.parametrize("plant", ["symlink", "foreign"])
def test_default_base_dir_planted_by_another_user_is_refused(
    plant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user plants the default base_dir's name in the shared temp directory (a symlink to a
    directory of theirs, or a directory of theirs): construction refuses it and creates nothing there."""
    shared = tmp_path / "shared-tmp"
    target = tmp_path / "theirs"
    shared.mkdir()
    target.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    planted = shared / f"llm-sandbox-middleware-{os.geteuid()}"
    if plant == "symlink":
        planted.symlink_to(target)
    else:
        planted.mkdir()
        if os.geteuid() == 0:
            os.chown(planted, 65534, 65534)  # nobody's
        else:
            planted.chmod(0o777)  # writable by everyone: others could swap sandbox directories in it
    with pytest.raises(SandboxArgumentError, match="base_dir"):
        LocalProvider(isolation="none")
    assert list(target.iterdir()) == []
