"""LocalProvider against hostile commands, one file per attack class, each attack run as untrusted code would.

Every test runs for ``isolation="bwrap"`` and ``isolation="none"`` (the ``isolation`` fixture), except
those marked ``bwrap_only`` (what only a namespace can hide: capabilities, host files, sockets, other
sandboxes). The machine runs everything as root, the worst case: a sandboxed root must still get nowhere.
Fixtures are in ``conftest.py``, markers and helpers in ``_support.py``.
"""
