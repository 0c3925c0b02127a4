"""Connect descriptors' signatures: HMAC-SHA256 under the provider's ``connect_key``.

Each provider says which fields its descriptor carries and how they are encoded for the MAC
(``local/_descriptors.py``, ``docker/_descriptors.py``); the signing and the check are these.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

from ..._errors import SandboxError

__all__ = ["check_signature", "mac", "require_mac"]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def mac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def require_mac(provider: str, descriptor: object) -> Mapping[str, object]:
    """``descriptor`` if it is a mapping with a ``mac``, else ``SandboxError``."""
    if not isinstance(descriptor, Mapping) or "mac" not in descriptor:
        raise SandboxError(f"{provider}.connect: not a descriptor from serialize_handle() (no 'mac')")
    return descriptor


def check_signature(provider: str, key: bytes, message: bytes, signature: object) -> None:
    """Nothing if ``signature`` is ``message``'s MAC under ``key``; else ``SandboxError``."""
    well_formed = isinstance(signature, str) and _HEX64.fullmatch(signature) is not None
    if not well_formed or not hmac.compare_digest(mac(key, message), str(signature)):
        raise SandboxError(
            f"{provider}.connect: the descriptor's signature does not match; it was not issued by this "
            "provider (or one sharing its connect_key), or it was altered"
        )
