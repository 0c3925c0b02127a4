from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """NeMo Gym's facade and providers are asyncio code."""
    return "asyncio"
