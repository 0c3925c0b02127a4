"""``ProviderBase``, what both providers inherit: the public ``exec``, NeMo Gym's signature and the checks
of its own arguments written once; each provider runs the checked call in its ``_exec``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from ..._protocol import SandboxExecResult, SandboxHandle
from ._arguments import checked_exec

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
    (``SandboxArgumentError`` naming the argument), then the provider's ``_exec``."""

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
