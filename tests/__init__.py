"""The test suite; ``ROOT`` is the checkout it tests."""

from pathlib import Path

ROOT = Path(__file__).parents[1]
"""The checkout's root: the working directory and the ``PYTHONPATH`` of the tests' subprocesses."""
