"""DockerProvider's connect descriptors: the container's id and the daemon's socket, signed with HMAC-SHA256.

Everything else a handle needs is read back from the container's labels on ``connect``, so the
descriptor carries nothing a forger could point elsewhere: a valid signature only says that this
provider (or one sharing its ``connect_key``) issued it for that container on that daemon.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

from ..._errors import SandboxError

__all__ = ["DESCRIPTOR_KEYS", "signed", "verified"]

DESCRIPTOR_KEYS = ("provider", "sandbox_id", "socket")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _mac(key: bytes, body: Mapping[str, str]) -> str:
    message = "\0".join(f"{name}={body[name]}" for name in DESCRIPTOR_KEYS).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed(key: bytes, provider: str, sandbox_id: str, socket: str) -> dict[str, Any]:
    body = {"provider": provider, "sandbox_id": sandbox_id, "socket": socket}
    return {**body, "mac": _mac(key, body)}


def verified(key: bytes, descriptor: object) -> dict[str, str]:
    """The signed fields of ``descriptor`` if its ``mac`` is theirs under ``key``; else ``SandboxError``."""
    if not isinstance(descriptor, Mapping) or "mac" not in descriptor:
        raise SandboxError("DockerProvider.connect: not a descriptor from serialize_handle() (no 'mac')")
    body = {name: descriptor.get(name) for name in DESCRIPTOR_KEYS}
    if not all(isinstance(value, str) and "\0" not in value for value in body.values()):
        raise SandboxError(f"DockerProvider.connect: the descriptor's {', '.join(DESCRIPTOR_KEYS)} must be strings")
    checked = {name: str(value) for name, value in body.items()}
    mac = descriptor["mac"]
    if not isinstance(mac, str) or not _HEX64.fullmatch(mac) or not hmac.compare_digest(_mac(key, checked), mac):
        raise SandboxError(
            "DockerProvider.connect: the descriptor's signature does not match; it was not issued by this "
            "provider (or one sharing its connect_key), or it was altered"
        )
    return checked
