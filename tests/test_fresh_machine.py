"""The README's test command on a fresh machine without bubblewrap: what needs bwrap is skipped, with one
line saying how to install it, and the run passes; with REQUIRE_BWRAP=1 (CI) the same run fails.

A few tests of each way a test comes to need bwrap (see ``tests/bwrap.py``), run by ``python -m pytest``
in a subprocess whose PATH has every system executable but bwrap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.bwrap import NOT_INSTALLED, path_without_bwrap

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "tests/sandbox/providers/local/test_local.py"
NEED_BWRAP = [
    f"{LOCAL}::test_pickles_as_its_options",  # LocalProvider() in the test: BwrapUnavailableError
    f"{LOCAL}::test_bwrap_isolation",  # its own skipif(no bwrap on PATH)
    "tests/sandbox/test_config.py::test_config_stack_is_the_hand_built_stack",  # a config's provider: local
    "tests/sandbox/cli/test_cli.py::test_every_session_failing_exits_3",  # the CLI in a subprocess: marked
]
OUTCOMES = ("skipped", "failure", "error")  # junit's elements; none: passed
RUN_ANYWAY = [
    f"{LOCAL}::test_connect_rebuilds_a_handle",  # isolation="none"
    f"{LOCAL}::test_bwrap_missing_is_a_construction_error",  # expects BwrapUnavailableError
]


def run_without_bwrap(tmp_path: Path, name: str, **env: str) -> tuple[int, dict[str, set[tuple[str, str]]], str]:
    """The selection's exit code, the (outcome, message) of each node id's tests (both anyio backends,
    say), and its output."""
    report = tmp_path / f"{name}.xml"
    temp = tmp_path / f"{name}-tmp"
    temp.mkdir()
    environment = {key: value for key, value in os.environ.items() if key != "REQUIRE_BWRAP"}
    environment |= {
        "PATH": path_without_bwrap(tmp_path / "bin", first=[Path(sys.executable).parent]),
        "TMPDIR": str(temp),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={report}",
         *NEED_BWRAP, *RUN_ANYWAY],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    outcomes: dict[str, set[tuple[str, str]]] = {}
    for case in ET.parse(report).iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "").split("[")[0]
        found = [(child.tag, child.get("message", "")) for child in case if child.tag in OUTCOMES]
        outcomes.setdefault(node, set()).add(found[0] if found else ("passed", ""))
    assert list(temp.iterdir()) == [], "the run left something in its temp dir"
    return done.returncode, outcomes, done.stdout + done.stderr


def test_without_bwrap_skips_what_needs_it_and_passes(tmp_path: Path) -> None:
    """REQUIRE_BWRAP unset: exit 0, each test needing bwrap skipped saying how to install it, the rest run."""
    code, outcomes, output = run_without_bwrap(tmp_path, "plain")
    assert code == 0, output
    assert sorted(outcomes) == sorted(NEED_BWRAP + RUN_ANYWAY), output
    skipped = {("skipped", f"{NOT_INSTALLED} (REQUIRE_BWRAP=1 turns this skip into a failure)")}
    for node in NEED_BWRAP:
        assert outcomes[node] == skipped, (node, outcomes[node])
    for node in RUN_ANYWAY:
        assert outcomes[node] == {("passed", "")}, (node, outcomes[node])
    assert "apt-get install bubblewrap" in NOT_INSTALLED
    assert output.count(NOT_INSTALLED) == 1, output  # -rs: one line for them all


def test_require_bwrap_turns_the_skips_into_failures(tmp_path: Path) -> None:
    """REQUIRE_BWRAP=1 (CI): the same run fails, each test needing bwrap failed saying why; the rest pass."""
    code, outcomes, output = run_without_bwrap(tmp_path, "required", REQUIRE_BWRAP="1")
    assert code == 1, output
    for node in NEED_BWRAP:
        assert {outcome for outcome, _ in outcomes[node]} <= {"failure", "error"}, (node, outcomes[node])
    for node in RUN_ANYWAY:
        assert outcomes[node] == {("passed", "")}, (node, outcomes[node])
    assert output.count("REQUIRE_BWRAP=1: CI must run the tests that need it") >= len(NEED_BWRAP), output
