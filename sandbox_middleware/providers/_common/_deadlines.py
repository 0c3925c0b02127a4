"""A sandbox's TTL and a command's deadline: ``spec.ttl_s`` checked against its bound, and the sooner of a
command's timeout and what is left of its sandbox's TTL."""

from __future__ import annotations

from ._arguments import positive_number

__all__ = ["MAX_TTL_S", "checked_ttl", "exec_deadline"]

MAX_TTL_S = 30 * 24 * 3600.0  # a month: far above any rollout, far below where a clock would overflow


def checked_ttl(ttl_s: object) -> float | None:
    """``spec.ttl_s`` as seconds (None: no TTL), or ``SandboxArgumentError``."""
    return positive_number(ttl_s, "spec.ttl_s", maximum=MAX_TTL_S)


def exec_deadline(timeout_s: float | None, remaining_s: float | None) -> float | None:
    """Seconds a command may run: its timeout, cut to what is left of its sandbox's TTL (None: unbounded)."""
    if remaining_s is None:
        return timeout_s
    return remaining_s if timeout_s is None else min(timeout_s, remaining_s)
