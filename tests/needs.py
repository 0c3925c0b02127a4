"""The one way a test says a real part it needs is absent: skipped in one line naming what is missing and
its install command; the part's ``REQUIRE_*`` flag (``.ci/run`` sets them) turns that skip into a failure.

Each part has its check beside it (``tests/bwrap.py``, ``tests/postgres.py``, ``tests/vllm/server.py``,
``tests/sandbox/providers/docker/_support.py``, ``tests/interop``, the Ray tests); all of them end here.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def required(flag: str) -> bool:
    return os.environ.get(flag) == "1"


def unavailable(reason: str, flag: str, *, module: bool = False) -> NoReturn:
    """Skip the calling test (``module``: its whole module) for ``reason``, which names what is missing and
    how to install it; with ``flag=1`` in the environment fail it instead."""
    if required(flag):
        pytest.fail(f"{reason} ({flag}=1: CI must run the tests that need it)", pytrace=False)
    pytest.skip(f"{reason} ({flag}=1 turns this skip into a failure)", allow_module_level=module)
