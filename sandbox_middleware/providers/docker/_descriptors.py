"""DockerProvider's connect descriptors: the container's id and the daemon's socket, signed by ``_common``.

Everything else a handle needs is read back from the container's labels on ``connect``, so the
descriptor carries nothing a forger could point elsewhere: a valid signature only says that this
provider (or one sharing its ``connect_key``) issued it for that container on that daemon.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._errors import SandboxError
from .._common._descriptors import check_signature, mac, require_mac

__all__ = ["DESCRIPTOR_KEYS", "signed", "verified"]

DESCRIPTOR_KEYS = ("provider", "sandbox_id", "socket")


def _message(body: Mapping[str, str]) -> bytes:
    return "\0".join(f"{name}={body[name]}" for name in DESCRIPTOR_KEYS).encode()


def signed(key: bytes, provider: str, sandbox_id: str, socket: str) -> dict[str, Any]:
    body = {"provider": provider, "sandbox_id": sandbox_id, "socket": socket}
    return {**body, "mac": mac(key, _message(body))}


def verified(key: bytes, descriptor: object) -> dict[str, str]:
    """The signed fields of ``descriptor`` if its ``mac`` is theirs under ``key``; else ``SandboxError``."""
    descriptor = require_mac("DockerProvider", descriptor)
    body = {name: descriptor.get(name) for name in DESCRIPTOR_KEYS}
    if not all(isinstance(value, str) and "\0" not in value for value in body.values()):
        raise SandboxError(f"DockerProvider.connect: the descriptor's {', '.join(DESCRIPTOR_KEYS)} must be strings")
    checked = {name: str(value) for name, value in body.items()}
    check_signature("DockerProvider", key, _message(checked), descriptor["mac"])
    return checked
