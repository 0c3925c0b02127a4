"""Servers started as a user starts them: a process that prints its URL on one line once it listens
(``python -m tokens.testing.server --port 0``, ``python -m tokens.proxy --port 0``), stopped after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).parents[1]
START_TIMEOUT_S = 60.0


def environment() -> dict[str, str]:
    """This process's environment with this checkout first on the path of a Python it starts."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@contextmanager
def served(arguments: Sequence[str], *, cwd: Path | None = None) -> Iterator[str]:
    """``python ARGUMENTS`` started with this checkout first on the path; yields the URL it prints.
    Stopped with SIGINT (Ctrl-C) on leaving (it must exit 0 within the timeout; its stderr is in the error)."""
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen([sys.executable, *arguments], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   cwd=cwd, env=environment())  # fmt: skip
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip()  # blocks until it listens, or exits
            if not url.startswith("http://"):
                process.wait(START_TIMEOUT_S)
                stderr.seek(0)
                raise AssertionError(f"{' '.join(arguments)} did not start (exit {process.returncode}): "
                                     f"{stderr.read().decode(errors='replace')}")  # fmt: skip
            yield url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                code = process.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            finally:
                if process.stdout is not None:
                    process.stdout.close()
            stderr.seek(0)
            assert code == 0, (
                f"{' '.join(arguments)} exited {code} when stopped: {stderr.read().decode(errors='replace')}"
            )
