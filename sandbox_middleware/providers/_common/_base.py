"""``ProviderBase``, what the providers inherit: the public ``exec`` and ``snapshot``, their signatures and
the checks of their own arguments written once; each provider runs the checked call in its ``_exec`` and
``_snapshot``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import NamedTuple

from ..._protocol import SandboxExecResult, SandboxHandle, SandboxSnapshot
from ._arguments import checked_exec, checked_snapshot

__all__ = ["ExecCall", "ProviderBase"]


class ExecCall(NamedTuple):  # not a frozen dataclass: made on every exec, a tuple costs a third as much
    """One ``exec``'s arguments as checked: ``env`` a fresh dict, ``timeout_s`` seconds (None: none);
    ``cwd`` (None: the sandbox's workdir) and ``user`` are each provider's to check."""

    command: str
    cwd: str | None
    env: dict[str, str]
    timeout_s: float | None
    user: str | int | None


class ProviderBase(ABC):
    """A provider whose ``exec`` is this one: the command's text, its environment and its timeout checked
    (``SandboxArgumentError`` naming the argument), then the provider's ``_exec``; and whose ``snapshot``
    is this one: the paths and the metadata checked, then the provider's ``_snapshot``."""

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` in ``handle``'s sandbox: in ``cwd`` (a sandbox path), with ``env`` over the
        sandbox's environment, for at most ``timeout_s`` seconds (and what is left of its TTL), as ``user``."""
        call_env, timeout = checked_exec(command, env, timeout_s)
        return await self._exec(handle, ExecCall(command, cwd, call_env, timeout, user))

    @abstractmethod
    async def _exec(self, handle: SandboxHandle, call: ExecCall) -> SandboxExecResult:
        """Run the checked ``call`` in ``handle``'s sandbox."""

    async def snapshot(
        self,
        handle: SandboxHandle,
        *,
        paths: list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> SandboxSnapshot:
        """A snapshot of ``handle``'s sandbox: its working directory, or ``paths`` (relative to it, or absolute
        in the sandbox), with ``metadata``."""
        checked_paths, labels = checked_snapshot(paths, metadata)
        return await self._snapshot(handle, checked_paths, labels)

    @abstractmethod
    async def _snapshot(
        self, handle: SandboxHandle, paths: list[str] | None, metadata: dict[str, str]
    ) -> SandboxSnapshot:
        """A snapshot of the checked ``paths`` (None: the working directory) of the sandbox, labelled ``metadata``."""
