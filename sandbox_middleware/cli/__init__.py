"""The ``sandbox-middleware`` command line: ``run`` a rollout-shaped workload through a stack and print
its telemetry, ``check`` a config, ``reap`` what a crashed run left behind (``cli/_main.py``)."""

from ._main import main

__all__ = ["main"]
