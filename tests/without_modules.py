"""A subprocess on a machine where some optional extras are not installed: ``env_without(tmp, "ray")`` is an
environment whose Python cannot import those modules (a ``sitecustomize`` on ``PYTHONPATH`` that answers
``ModuleNotFoundError`` for them, as a missing distribution does), with this checkout still first."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SITECUSTOMIZE = """\
import os, sys
from importlib.abc import MetaPathFinder

class _Missing(MetaPathFinder):
    names = tuple(filter(None, os.environ.get("TESTS_MISSING_MODULES", "").split(",")))

    def find_spec(self, name, path=None, target=None):
        if any(name == missing or name.startswith(missing + ".") for missing in self.names):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Missing())
"""


def env_without(directory: Path, *modules: str) -> dict[str, str]:
    """The environment of a subprocess that cannot import ``modules`` (nor anything below them)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join([str(directory), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "TESTS_MISSING_MODULES": ",".join(modules)}
