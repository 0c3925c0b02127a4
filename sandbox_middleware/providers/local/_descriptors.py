"""LocalProvider's connect descriptors: a sandbox's record, signed with HMAC-SHA256 under the provider's key.

``serialize_handle`` signs the fields of ``DESCRIPTOR_KEYS``; ``connect`` accepts a descriptor only
if the signature matches, so only this provider (or one sharing its ``connect_key``) can have
issued it. Which sandbox directory it may name is checked by ``connect`` itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any

from ..._errors import SandboxError

__all__ = ["DESCRIPTOR_KEYS", "sign", "verified_body"]

DESCRIPTOR_KEYS = (
    "provider", "sandbox_id", "root", "view_root", "env", "cwd", "ports", "expires_at", "limits", "metadata", "created",
    "uid",
)  # fmt: skip
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sign(key: bytes, body: Mapping[str, Any]) -> str:
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def verified_body(key: bytes, descriptor: Mapping[str, Any]) -> dict[str, Any]:
    """The signed fields of ``descriptor``, if its ``mac`` is theirs under ``key``; else ``SandboxError``."""
    if not isinstance(descriptor, Mapping) or "mac" not in descriptor:
        raise SandboxError("LocalProvider.connect: not a descriptor from serialize_handle() (no 'mac')")
    try:  # NeMo Gym's facades add their own keys (workdir, ports): the MAC covers only ours
        body = {name: descriptor[name] for name in DESCRIPTOR_KEYS}
        expected = sign(key, body)
    except Exception as exc:  # a hostile mapping: raising items(), cycles, deep nesting
        raise SandboxError(f"LocalProvider.connect: descriptor is not plain JSON data: {exc!r:.200}") from exc
    mac = descriptor["mac"]
    if not isinstance(mac, str) or not _HEX64.fullmatch(mac) or not hmac.compare_digest(expected, mac):
        raise SandboxError(
            "LocalProvider.connect: the descriptor's signature does not match; it was not issued by this "
            "provider (or one sharing its connect_key), or it was altered"
        )
    return body
