"""Sandbox providers of this package, one package each (``providers/<name>/``); see README.md here."""

from .local import LocalProvider

__all__ = ["LocalProvider"]
