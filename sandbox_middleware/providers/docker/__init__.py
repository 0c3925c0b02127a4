"""``DockerProvider``: sandboxes as containers of a Docker daemon, over its Engine API, hardened by default."""

from ._provider import DockerProvider

__all__ = ["DockerProvider"]
