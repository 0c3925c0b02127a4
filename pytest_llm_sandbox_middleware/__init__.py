"""The pytest plugin of the whole distribution (entry point ``pytest11``): fixtures for both halves,
active wherever ``llm-sandbox-middleware`` is installed.

Fixtures, with no import needed in the tests that use them:

- ``fake_vllm``: a ``FakeVLLM`` answering every request to ``FAKE_VLLM_URL`` through respx (needs
  ``respx``); point a ``TokenClient`` or the OpenAI SDK at ``FAKE_VLLM_URL + "/v1"``.
- ``capture_proxy``: the token-capture proxy (``tokens.proxy``, needs the ``proxy`` extra) served on
  a loopback port in front of its own ``FakeVLLM`` (``capture_proxy.fake``); point the ``openai`` SDK
  at ``capture_proxy.base_url("rollout-1")`` and the ``anthropic`` SDK at
  ``capture_proxy.base_url("rollout-1").removesuffix("/v1")``.
- ``fault_provider``: an in-memory ``FaultInjectingProvider`` without faults (build a faulty one
  with ``FaultInjectingProvider(failure_rates=...)`` from ``sandbox_middleware.testing``).
- ``telemetry`` (and ``meter_provider``, ``tracer_provider``, ``metric_reader``,
  ``span_exporter``): the in-memory OpenTelemetry SDK of ``sandbox_middleware.testing.fixtures``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from sandbox_middleware.testing import FaultInjectingProvider
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

if TYPE_CHECKING:
    from tokens.proxy import ProxyServer

pytest_plugins = ["sandbox_middleware.testing.fixtures"]

__all__ = ["CaptureProxy", "FakeVLLMTransport", "capture_proxy", "fake_vllm", "fault_provider", "running_capture_proxy"]


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


class FakeVLLMTransport(httpx.AsyncBaseTransport):
    """A ``FakeVLLM`` as an httpx transport whose bodies arrive as a stream, one event (or 64 KiB) at
    a time, as a real server's do (``httpx.MockTransport`` hands over bodies already read)."""

    def __init__(self, fake: FakeVLLM) -> None:
        self.fake = fake

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        answer = self.fake(request)
        return httpx.Response(answer.status_code, headers=answer.headers, stream=_Pieces(answer.content))


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        data = self._data
        events = data.split(b"\n\n")
        if len(events) > 2:  # server-sent events: one at a time
            for event in events[:-1]:
                yield event + b"\n\n"
            return
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]


@dataclass(frozen=True)
class CaptureProxy:
    """The ``capture_proxy`` fixture's value: the running server (``url``, ``base_url(rollout_id)``)
    and the ``FakeVLLM`` behind it."""

    server: ProxyServer
    fake: FakeVLLM

    @property
    def url(self) -> str:
        """The proxy's root URL, ``http://127.0.0.1:<port>``."""
        return self.server.url

    def base_url(self, rollout_id: str | None = None) -> str:
        """``<url>/r/<rollout_id>/v1`` (``<url>/v1`` without a rollout id): the OpenAI SDK's base URL."""
        return self.server.base_url(rollout_id)


@contextmanager
def running_capture_proxy(**options: Any) -> Iterator[CaptureProxy]:
    """The capture proxy on a loopback port in front of a fresh ``FakeVLLM`` (``options`` go to
    ``tokens.proxy.create_app``), stopped on leaving the block."""
    from tokens.proxy import ProxyServer, create_app  # the proxy extra, imported only when asked for

    fake = FakeVLLM()
    with ProxyServer(create_app(FAKE_VLLM_URL + "/v1", transport=FakeVLLMTransport(fake), **options)) as server:
        yield CaptureProxy(server, fake)


@pytest.fixture
def capture_proxy() -> Iterator[CaptureProxy]:
    """The capture proxy on a loopback port in front of a fresh ``FakeVLLM``, stopped after the test."""
    with running_capture_proxy() as proxy:
        yield proxy
