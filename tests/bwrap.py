"""Tests that need bubblewrap (``LocalProvider(isolation="bwrap")``, the default): skipped where it cannot run.

The skip is one line saying what to install; ``REQUIRE_BWRAP=1`` (CI, which installs it) turns it into a
failure. ``tests/conftest.py`` applies it to every test, with no marker needed on most:

- a test (or a fixture of it) that raises ``BwrapUnavailableError`` on a machine where bwrap cannot run
  is skipped; one that expects the error (``pytest.raises``) never lets it out, so it runs as ever, and
  where bwrap does run the error is a failure like any other;
- a test skipped by a marker of its own whose reason mentions bwrap (``skipif(not HAS_BWRAP, ...)``)
  gets the same line, and fails under ``REQUIRE_BWRAP=1``;
- a test that needs bwrap in a subprocess (the CLI) is marked ``@pytest.mark.requires_bwrap``, or
  ``@pytest.mark.requires_bwrap(condition)`` when it needs it only if ``condition`` is true.

``path_without_bwrap`` builds the ``PATH`` of a machine without bubblewrap, to see all this happen.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import anyio

from sandbox_middleware import BwrapUnavailableError, LocalProvider

from . import needs

REQUIRE = "REQUIRE_BWRAP"
NOT_INSTALLED = "bubblewrap is not installed: apt-get install bubblewrap"
SYSTEM_BIN = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def bwrap_problem() -> str | None:
    """Why ``LocalProvider(isolation="bwrap")`` cannot be built here (the skip reason), or None if it can."""
    bwrap = shutil.which("bwrap")
    return NOT_INSTALLED if bwrap is None else _cannot_run(bwrap)


@functools.cache
def _cannot_run(bwrap: str) -> str | None:
    """Whether the bwrap on PATH runs (unprivileged user namespaces may be disabled): built once a run."""
    base = Path(tempfile.mkdtemp(prefix="bwrap-probe-"))
    base.chmod(0o711)  # the sandbox's unprivileged uid must reach its base_dir
    try:
        anyio.run(LocalProvider(isolation="bwrap", base_dir=base / "boxes").aclose)
    except BwrapUnavailableError as exc:
        reason = " ".join(str(exc).split())
        return f"bubblewrap ({bwrap}) cannot run here: {reason}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return None


def required() -> bool:
    return needs.required(REQUIRE)


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test for ``reason``, in one line; with ``REQUIRE_BWRAP=1`` fail it instead."""
    needs.unavailable(reason, REQUIRE)


def only_bwrap_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``BwrapUnavailableError``, or a group of nothing else (a task group's)."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(BwrapUnavailableError)
        return rest is None
    return isinstance(exc, BwrapUnavailableError)


def path_without_bwrap(directory: Path, first: Sequence[str | Path] = ()) -> str:
    """A ``PATH`` of ``first`` then ``directory``, filled with links to every system executable but bwrap."""
    directory.mkdir(parents=True, exist_ok=True)
    for system in SYSTEM_BIN:
        if not os.path.isdir(system):
            continue
        for entry in os.scandir(system):
            link = directory / entry.name
            if entry.name != "bwrap" and not link.exists() and not link.is_symlink():
                link.symlink_to(entry.path)
    return os.pathsep.join([*map(str, first), str(directory)])
