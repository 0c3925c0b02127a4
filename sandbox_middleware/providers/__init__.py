"""Sandbox providers of this package, one package each (``providers/<name>/``).

Provider authors start at providers/README.md.
"""

from .docker import DockerProvider
from .local import LocalProvider

__all__ = ["DockerProvider", "LocalProvider"]
