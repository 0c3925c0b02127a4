"""The errors of ``tokens.testing``."""

from __future__ import annotations

__all__ = ["ScriptError"]


class ScriptError(ValueError):
    """A served fake's script (a file or a command-line option) that cannot be used: the message says
    where (the file and the entry, or the option), what is wrong, and what to write instead."""
