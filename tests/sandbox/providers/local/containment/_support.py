"""Markers and helpers shared by the containment tests (their fixtures are in ``conftest.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HAS_BWRAP = shutil.which("bwrap") is not None
ISOLATIONS = [pytest.param("bwrap", marks=pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")), "none"]
bwrap_only = pytest.mark.skipif(not HAS_BWRAP, reason="bwrap is not installed")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the limits tested here need root (cgroups, tmpfs)")


def quote(text: str) -> str:
    """``text`` as one shell word."""
    return "'" + text.replace("'", "'\"'\"'") + "'"


NOBODY = 65534
_ROOT = Path(__file__).resolve().parents[5]  # the checkout


def _unprivileged_python() -> str | None:
    """A Python of this one's version that an unprivileged user may run (this one may live under /root)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        path = Path(candidate)
        if path.exists() and all(p.stat().st_mode & 0o001 for p in path.resolve().parents):
            return str(path)
    return None


def run_unprivileged(script: str, sandbox_base: Path) -> Any:
    """Run ``script`` (given a base_dir of its own as argv[1]) as user nobody, with this checkout and
    its installed packages importable; returns the JSON it prints. As a normal user the whole suite
    already runs unprivileged, so this runs as root only."""
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the other tests cover it")
    python = _unprivileged_python()
    if python is None or shutil.which("setpriv") is None:
        pytest.skip(f"needs setpriv and a python{sys.version_info.major}.{sys.version_info.minor} nobody may run")
    base = sandbox_base.parent / "unprivileged"
    base.mkdir(mode=0o711)
    os.chown(base, NOBODY, NOBODY)
    paths = [str(_ROOT), *(p for p in sys.path if p.endswith("site-packages"))]
    run = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-c", script, str(base)],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base), "PYTHONPATH": ":".join(paths),
             "TMPDIR": str(base)},
        capture_output=True, timeout=300, check=False, cwd=base,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return json.loads(run.stdout)
