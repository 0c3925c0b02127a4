"""LocalProvider's connect descriptors: a sandbox's record, signed by ``_common`` under the provider's key.

``serialize_handle`` signs the fields of ``DESCRIPTOR_KEYS``; ``connect`` accepts a descriptor only
if the signature matches, so only this provider (or one sharing its ``connect_key``) can have
issued it. Which sandbox directory it may name is checked by ``connect`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..._errors import SandboxError
from .._common._descriptors import check_signature, mac, require_mac

__all__ = ["DESCRIPTOR_KEYS", "sign", "verified_body"]

DESCRIPTOR_KEYS = (
    "provider",
    "sandbox_id",
    "root",
    "view_root",
    "env",
    "cwd",
    "ports",
    "expires_at",
    "limits",
    "metadata",
    "created",
    "uid",
    "snapshot",
)


def _message(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def sign(key: bytes, body: Mapping[str, Any]) -> str:
    return mac(key, _message(body))


def verified_body(key: bytes, descriptor: Mapping[str, Any]) -> dict[str, Any]:
    """The signed fields of ``descriptor``, if its ``mac`` is theirs under ``key``; else ``SandboxError``."""
    descriptor = require_mac("LocalProvider", descriptor)
    try:  # NeMo Gym's facades add their own keys (workdir, ports): the MAC covers only ours
        body = {name: descriptor[name] for name in DESCRIPTOR_KEYS}
        message = _message(body)
    except Exception as exc:  # a hostile mapping: raising items(), cycles, deep nesting
        raise SandboxError(f"LocalProvider.connect: descriptor is not plain JSON data: {exc!r:.200}") from exc
    check_signature("LocalProvider", key, message, descriptor["mac"])
    return body
