"""The pytest plugin of the whole distribution (entry point ``pytest11``): fixtures for both halves,
active wherever ``llm-sandbox-middleware`` is installed.

Fixtures, with no import needed in the tests that use them:

- ``fake_vllm``: a ``FakeVLLM`` answering every request to ``FAKE_VLLM_URL`` through respx (needs
  ``respx``); point a ``TokenClient`` or the OpenAI SDK at ``FAKE_VLLM_URL + "/v1"``.
- ``fault_provider``: an in-memory ``FaultInjectingProvider`` without faults (build a faulty one
  with ``FaultInjectingProvider(failure_rates=...)`` from ``sandbox_middleware.testing``).
- ``telemetry`` (and ``meter_provider``, ``tracer_provider``, ``metric_reader``,
  ``span_exporter``): the in-memory OpenTelemetry SDK of ``sandbox_middleware.testing.fixtures``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox_middleware.testing import FaultInjectingProvider
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

pytest_plugins = ["sandbox_middleware.testing.fixtures"]

__all__ = ["fake_vllm", "fault_provider"]


@pytest.fixture
def fake_vllm() -> Iterator[FakeVLLM]:
    """A fake vLLM serving ``FAKE_VLLM_URL`` through respx for the test's duration."""
    import respx  # a test dependency of the user's, imported only when the fixture is used

    fake = FakeVLLM()
    with respx.mock(assert_all_called=False) as router:
        router.route(url__startswith=FAKE_VLLM_URL).mock(side_effect=fake)
        yield fake


@pytest.fixture
def fault_provider() -> FaultInjectingProvider:
    """An in-memory sandbox provider that keeps the ground truth (``alive``) and injects faults on request."""
    return FaultInjectingProvider()
