"""Sandbox providers of this package, one package each (``providers/<name>/``); provider authors start at providers/README.md."""

from .local import LocalProvider

__all__ = ["LocalProvider"]
