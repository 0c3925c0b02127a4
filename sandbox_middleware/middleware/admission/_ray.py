"""The admission ledger in one small named Ray actor, shared by every process of a Ray cluster.

The actor (``sandbox_middleware.admission.<key>`` in the ``sandbox_middleware`` namespace, no CPU
reserved) holds one ``Ledger`` and applies each operation with its own clock, so the processes'
clocks never meet. It is detached: it outlives any one worker (a crashed worker does not take the
shared limit with it) and is removed with the cluster or by ``ray.kill``.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from ..._errors import SandboxAdmissionError
from ._ledger import BACKEND_TIMEOUT_S, Ledger, apply

__all__ = ["ACTOR_NAMESPACE", "RayBackend", "actor_name"]

ACTOR_NAMESPACE = "sandbox_middleware"


def actor_name(key: str) -> str:
    return f"sandbox_middleware.admission.{key}"


class _LedgerActor:
    """The Ray actor: one ledger, one operation at a time (a Ray actor runs its calls in order)."""

    def __init__(self) -> None:
        self.ledger = Ledger()

    def call(self, operation: str, args: tuple[Any, ...]) -> Any:
        return apply(self.ledger, operation, args)


class RayBackend:
    """Talks to the key's actor (made by whichever process asks first); calls wait in a worker thread."""

    shared = True

    def __init__(self, key: str) -> None:
        self.key = key
        self._actor: Any = None

    def __repr__(self) -> str:
        return f"RayBackend(key={self.key!r})"

    def _get(self, operation: str, args: tuple[Any, ...]) -> Any:
        import ray

        if self._actor is None:
            if not ray.is_initialized():
                raise SandboxAdmissionError(
                    "admission: shared: ray needs a connected Ray process (a Ray worker, or a driver after "
                    "ray.init(address=...)); none is here"
                )
            actor = ray.remote(num_cpus=0, max_restarts=-1)(_LedgerActor)
            options = {"name": actor_name(self.key), "namespace": ACTOR_NAMESPACE, "lifetime": "detached"}
            self._actor = actor.options(**options, get_if_exists=True).remote()
        return ray.get(self._actor.call.remote(operation, args), timeout=BACKEND_TIMEOUT_S)

    async def call(self, operation: str, *args: Any) -> Any:
        try:
            return await anyio.to_thread.run_sync(self._get, operation, args)
        except SandboxAdmissionError:
            raise
        except Exception as exc:  # Ray's errors: the actor died, a timeout, the cluster went away
            older = (
                "; an actor made by an older version of sandbox_middleware (detached, it outlives the jobs) lacks "
                f"this operation: remove it with ray.kill(ray.get_actor({actor_name(self.key)!r}, "
                f"namespace={ACTOR_NAMESPACE!r})) when no job uses it"
                if isinstance(exc, AttributeError)  # Ray raises the remote error as an instance of its cause too
                else ""
            )
            raise SandboxAdmissionError(
                f"admission: the Ray actor {actor_name(self.key)!r} (namespace {ACTOR_NAMESPACE!r}) failed during "
                f"{operation}: {type(exc).__name__}: {exc}{older}"
            ) from exc

    async def aclose(self) -> None:
        self._actor = None
