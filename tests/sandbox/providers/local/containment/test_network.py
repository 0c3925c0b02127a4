"""Sockets to the host: filesystem and abstract unix sockets, and AF_VSOCK, which no network namespace covers."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sandbox_middleware import LocalProvider, SandboxSpec

from ._support import bwrap_only, quote

pytestmark = pytest.mark.anyio


@bwrap_only
async def test_host_unix_sockets_are_out_of_reach(
    make: Callable[..., LocalProvider], tmp_path: Path, sandbox_base: Path
) -> None:
    """Neither a filesystem socket in /run nor an abstract one on the host can be reached."""
    path = Path("/run") / f"containment-{uuid.uuid4().hex[:8]}.sock"
    abstract = f"\0containment-{uuid.uuid4().hex[:8]}"
    listeners = []
    for address in (str(path), abstract):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen()
        listeners.append(listener)
    local = make(isolation="bwrap", base_dir=sandbox_base)
    try:
        handle = await local.create(SandboxSpec())
        probe = (
            "import socket, sys\n"
            "for address in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    try:\n"
            "        s.connect(address.replace('@', '\\0'))\n"
            "        print('connected', address)\n"
            "    except OSError as exc:\n"
            "        print('refused', address, exc.errno)\n"
        )
        result = await local.exec(handle, f"python3 -c {quote(probe)} {path} @{abstract[1:]}")
        assert "connected" not in result.stdout
        assert result.stdout.count("refused") == 2
    finally:
        await local.aclose()
        for listener in listeners:
            listener.close()
        path.unlink(missing_ok=True)


@bwrap_only
async def test_vsock_is_refused(make: Callable[..., LocalProvider], sandbox_base: Path) -> None:
    """AF_VSOCK, which no network namespace covers, cannot even be opened."""
    local = make(isolation="bwrap", base_dir=sandbox_base)
    handle = await local.create(SandboxSpec())
    probe = (
        "import socket\ntry:\n    socket.socket(40, socket.SOCK_STREAM)\n    print('opened')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    other = "python3 -c 'import socket; socket.socket(); print(1)'"
    result = await local.exec(handle, f"python3 -c {quote(probe)}; {other}")
    assert result.stdout.splitlines() == ["refused 1", "1"]  # EPERM; other families still work
