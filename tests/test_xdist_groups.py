"""The groups of ``tests/conftest.py`` hold: under ``--dist loadgroup`` (``.ci/run``), a grouped test's
node id names its group, which is how pytest-xdist keeps a group's tests on one worker, one after
another. With pytest 9.2 and pytest-xdist 3.8 no group held (pytest keeps node ids as ``NodeId``
objects; xdist rewrites ``_nodeid``), and the tests that must not share the machine ran side by side."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("groups-check")
def test_a_grouped_test_s_node_id_names_its_group(request: pytest.FixtureRequest) -> None:
    if not hasattr(request.config, "workerinput") or not request.config.getvalue("loadgroup"):
        pytest.skip("only under pytest-xdist's --dist loadgroup (python -m pytest -n 2 --dist loadgroup)")
    assert request.node.nodeid.endswith("@groups-check"), (
        f"pytest {pytest.__version__} with this pytest-xdist keeps no group: install the versions "
        "pyproject.toml's test extra allows"
    )
