"""Servers started as a user starts them: a process that prints its URL on one line once it listens
(``python -m tokens.testing.server --port 0``, ``python -m tokens.proxy --port 0``), stopped after."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests import ROOT

START_TIMEOUT_S = 60.0


def environment() -> dict[str, str]:
    """This process's environment with this checkout first on the path of a Python it starts."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@contextmanager
def served(arguments: Sequence[str], *, cwd: Path | None = None) -> Iterator[str]:
    """``python ARGUMENTS`` started with this checkout first on the path; yields the URL it prints.
    Stopped with SIGINT (Ctrl-C) on leaving (it must exit 0 within the timeout; its stderr is in the error)."""
    with started(arguments, cwd=cwd) as (url, _):
        yield url


@contextmanager
def started(arguments: Sequence[str], *, cwd: Path | None = None) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``served``, yielding the process too (a test may kill it: then it is not stopped again)."""
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [sys.executable, *arguments], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd, env=environment()
        )
        assert process.stdout is not None
        try:
            with selectors.DefaultSelector() as selector:  # the URL line, or its exit, within the timeout
                selector.register(process.stdout, selectors.EVENT_READ)
                ready = selector.select(START_TIMEOUT_S)
            url = process.stdout.readline().strip() if ready else ""
            if not url.startswith("http://"):
                process.kill()
                process.wait()
                stderr.seek(0)
                raise AssertionError(
                    f"{' '.join(arguments)} did not start (exit {process.returncode}): "
                    f"{stderr.read().decode(errors='replace')}"
                )
            yield url, process
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                code = process.wait(START_TIMEOUT_S)
                stderr.seek(0)
                assert code == 0, (
                    f"{' '.join(arguments)} exited {code} when stopped: {stderr.read().decode(errors='replace')}"
                )
        finally:
            if process.poll() is None:  # the block raised, or the process did not stop in time
                process.kill()
                process.wait()
            process.stdout.close()
