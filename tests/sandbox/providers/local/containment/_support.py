"""Markers and helpers shared by the containment tests (their fixtures are in ``conftest.py``)."""

from __future__ import annotations

import os
import shutil

import pytest

HAS_BWRAP = shutil.which("bwrap") is not None
ISOLATIONS = [pytest.param("bwrap", marks=pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")), "none"]
bwrap_only = pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the limits tested here need root (cgroups, tmpfs)")


def quote(text: str) -> str:
    """``text`` as one shell word."""
    return "'" + text.replace("'", "'\"'\"'") + "'"
