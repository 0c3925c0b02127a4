"""``LocalProvider``: real sandboxes on this machine (bubblewrap), hardened against the commands they run."""

from ._provider import LocalProvider

__all__ = ["LocalProvider"]
