"""Privileges: no capability, no way to remount, no nested user namespace, no host root, no kernel keyring.

Commands run as an unprivileged host uid of their own under a seccomp filter (bwrap only: without a
namespace there is nothing to drop).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_middleware import LocalProvider, SandboxSpec

from ._support import as_root, bwrap_only, quote

pytestmark = pytest.mark.anyio


@bwrap_only
async def test_no_capabilities_and_remount_fails(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """No capability inside; remounting a read-only host directory read-write fails; the canary is unchanged."""
    shared = sandbox_base.parent / "shared"
    shared.mkdir()
    canary = shared / "canary.txt"
    canary.write_text("host")
    local = make(isolation="bwrap", base_dir=sandbox_base, ro_paths=[str(shared)])
    handle = await local.create(SandboxSpec())
    caps = await local.exec(handle, "grep -E '^Cap(Eff|Prm|Bnd|Amb):' /proc/self/status")
    assert {line.split()[1] for line in caps.stdout.splitlines()} == {"0000000000000000"}
    attack = await local.exec(
        handle,
        f"mount -o remount,bind,rw {shared} && echo pwned > {canary}; echo pwned > {canary}; "
        f"mount -t tmpfs none {shared} && echo mounted; cat {canary}",
    )
    assert "mounted" not in attack.stdout
    assert attack.stdout.strip() == "host"
    assert canary.read_text() == "host"
    nested = await local.exec(handle, "unshare -Ur true && echo nested")
    assert "nested" not in nested.stdout
    await local.aclose()


@bwrap_only
@as_root
async def test_host_kernel_settings_and_keyrings_are_out_of_reach(
    make: Callable[..., LocalProvider], sandbox_base: Path
) -> None:
    """Commands run as an unprivileged host uid: /proc/sys is not writable, the kernel keyring calls
    are denied (seccomp), / and /dev are read-only, and what they write belongs to that uid on the host."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    setting = Path("/proc/sys/kernel/printk_ratelimit_burst")
    before = setting.read_text()
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('keyctl', libc.syscall(250, 0, -3, 0), ctypes.get_errno())\n"  # KEYCTL_GET_KEYRING_ID
        "print('add_key', libc.syscall(248, b'user', b'k', b'v', 1, -3), ctypes.get_errno())\n"
    )
    result = await local.exec(
        handle,
        f"echo 99 > {setting}; echo x > /new; echo x > /dev/new; touch mine; python3 -c {quote(probe)}"
        if os.uname().machine == "x86_64"
        else f"echo 99 > {setting}; touch mine",
    )
    assert setting.read_text() == before
    assert "Permission denied" in result.stderr
    if os.uname().machine == "x86_64":
        assert result.stderr.count("Read-only file system") == 2
        assert "keyctl -1 1" in result.stdout and "add_key -1 1" in result.stdout  # EPERM
    owner = (Path(handle.raw["root"]) / "mine").stat()
    assert owner.st_uid == owner.st_gid == local._boxes[handle.sandbox_id].uid
    assert owner.st_uid not in (0, 65534)  # its own uid, shared with no account and no other sandbox
