"""Spare sandboxes: under bwrap, ``spares`` sandboxes of the shape last asked for are made ahead, in the background.

Most of a bwrap sandbox's create is its command starter's start (bwrap, then a Python interpreter:
30-60 ms on a loaded machine). ``Spares`` (``_common/_spares.py``) keeps ``spares`` sandboxes (one by
default) of the shape the last create asked for (its limits and view root: what its directory,
cgroups, mounts, uid and starter are made of) ready, so the next creates of that shape take them and
only write their record and make their working directory (a fork's also mounts its snapshot's files on
it); the next spares are made behind them. A spare has run nothing: no
command has started in it, nothing else holds it. While it is a spare its directory holds
``SPARE_RECORD`` (its maker: host, pid, start time, PID namespace) instead of the record ``list``
reads, so no listing shows it. Spares are removed at ``aclose``, when the provider is collected or
at interpreter exit (its finalizer), and, when their process died without either, by the next
provider made on the same base_dir or by ``reap`` (``LocalProvider.sweep_leftovers``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

from .._common._spares import Spares as _Spares
from ._records import Box

__all__ = ["Spares"]

Shape = TypeVar("Shape", bound=Hashable)


class Spares(_Spares[Shape, Box]):
    """LocalProvider's spare: handed out only while its command starter lives."""

    who = "LocalProvider"

    def usable(self, item: Box) -> bool:
        return item.starter is not None and item.starter.alive
