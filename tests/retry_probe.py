"""Counting stamina's retry contexts, for the tests that retries cost nothing until a call fails."""

from __future__ import annotations

from typing import Any

import pytest
import stamina


def count_retry_contexts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one entry each time ``stamina.retry_context`` is entered (it still works)."""
    entered: list[int] = []
    real = stamina.retry_context

    def counting(*args: Any, **kwargs: Any) -> Any:
        entered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stamina, "retry_context", counting)
    return entered
