"""Replicas of one upstream, in process: the order a call's affinity gives, failover on a 5xx with the
replica marked down (and backoff), no failover for a client's error, the record's ``served_by``; and
where the proxy keeps ``previous_response_id`` turns (memory, or the store, with their bounds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tokens.proxy import ProxyServer, RequestRejectedError, create_app
from tokens.proxy._affinity import BACKOFF_S, MAX_BACKOFF_S, Replicas
from tokens.proxy._history import MemoryHistory, StoreHistory
from tokens.records import open_store
from tokens.testing import FakeVLLM

HOSTS = ("replica-0", "replica-1", "replica-2")


class _Upstream:
    def __init__(self, base: str) -> None:
        self.base = base


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_asks_one_replica_first_and_one_marked_down_last() -> None:
    clock = _Clock()
    replicas = Replicas([_Upstream(f"http://{host}/v1") for host in HOSTS], clock)  # type: ignore[list-item]
    order = replicas.order("rollout-7")
    assert replicas.order("rollout-7") == order and sorted(r.name for r in order) == sorted(
        r.name for r in replicas.replicas
    )
    assert len({replicas.order(f"rollout-{n}")[0].name for n in range(30)}) == 3  # keys spread over every replica
    first = order[0]
    replicas.failed(first)
    assert replicas.order("rollout-7") == [*order[1:], first]
    downs = []
    for _ in range(10):  # the backoff doubles for each failure in a row, up to its cap
        downs.append(first.down_until - clock.now)
        replicas.failed(first)
    assert downs[:3] == [BACKOFF_S, 2 * BACKOFF_S, 4 * BACKOFF_S] and max(downs) == MAX_BACKOFF_S
    clock.now = first.down_until
    assert replicas.order("rollout-7") == order  # back first once its time is up
    replicas.succeeded(first)
    assert first.failures == 0 and first.down_until == 0.0


@pytest.fixture
def fakes() -> list[FakeVLLM]:
    return [FakeVLLM() for _ in HOSTS]


@pytest.fixture
def served(fakes: list[FakeVLLM], tmp_path: Path) -> Iterator[tuple[ProxyServer, str]]:
    def route(request: httpx.Request) -> httpx.Response:
        return fakes[HOSTS.index(request.url.host)](request)

    url = f"sqlite:///{tmp_path / 'records.db'}"
    store = open_store(url)
    app = create_app([f"http://{host}/v1" for host in HOSTS], store=store, transport=httpx.MockTransport(route))
    with ProxyServer(app) as server:
        yield server, url
    anyio.run(store.close)


def _records(url: str, rollout: str) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        async with open_store(url) as store:
            return {record.model_call_id: record for record in await store.records(rollout)}

    return anyio.run(read)


def _ask(server: ProxyServer, call: str, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": call}]}
    return httpx.post(
        server.base_url("ro") + "/chat/completions", json=body, headers={"X-Model-Call-Id": call, **headers}
    )


def test_a_5xx_fails_over_and_the_replica_waits_out_its_backoff(
    served: tuple[ProxyServer, str], fakes: list[FakeVLLM]
) -> None:
    server, url = served
    assert _ask(server, "c0").status_code == 200
    home = HOSTS.index(httpx.URL(_records(url, "ro")["c0"].served_by).host)
    fakes[home].fail_next(500)
    asked = len(fakes[home].requests)
    assert _ask(server, "c1").status_code == 200  # the client sees one answer
    assert len(fakes[home].requests) == asked + 1  # the home replica was asked first and failed
    after = _records(url, "ro")["c1"].served_by
    assert after != _records(url, "ro")["c0"].served_by
    assert _ask(server, "c2").status_code == 200
    assert len(fakes[home].requests) == asked + 1  # marked down: not asked again within its backoff
    assert _records(url, "ro")["c2"].served_by == after


def test_a_client_error_is_not_failed_over_and_a_session_header_picks_the_replica(
    served: tuple[ProxyServer, str], fakes: list[FakeVLLM]
) -> None:
    server, url = served
    for call in ("s0", "s1"):
        assert _ask(server, call, **{"X-Session-Id": "group-1"}).status_code == 200
    records = _records(url, "ro")
    home = HOSTS.index(httpx.URL(records["s0"].served_by).host)
    assert records["s1"].served_by == records["s0"].served_by
    fakes[home].reply_error(400, "bad request")
    others = [len(fake.requests) for index, fake in enumerate(fakes) if index != home]
    answer = _ask(server, "s2", **{"X-Session-Id": "group-1"})
    assert answer.status_code == 400
    assert [len(fake.requests) for index, fake in enumerate(fakes) if index != home] == others


def test_replicas_are_checked() -> None:
    with pytest.raises(ValueError, match="names one replica twice"):
        create_app(["http://a:8000/v1", "http://a:8000/v1/"])
    with pytest.raises(ValueError, match="must be an http"):
        create_app([])
    with pytest.raises(ValueError, match=r"upstream_url\['m'\] must be an http"):
        create_app({"m": ["http://a/v1", "ftp://b"]})
    with pytest.raises(ValueError, match="previous_ttl must be a positive number of seconds"):
        create_app("http://a/v1", previous_ttl=0)


@pytest.mark.anyio
async def test_memory_turns_chain_and_an_evicted_turn_is_named() -> None:
    history = MemoryHistory(2)
    await history.put("resp_a", [{"a": 1}], None, "call-a", {})
    await history.put("resp_b", [{"b": 2}], "resp_a", "call-b", {})
    assert await history.get("resp_b") == ([{"a": 1}, {"b": 2}], "call-b")
    await history.put("resp_c", [{"c": 3}], "resp_b", "call-c", {})  # a chain's latest turn goes before its first
    with pytest.raises(RequestRejectedError, match="earlier turn 'resp_b' is no longer kept") as refused:
        await history.get("resp_c")
    assert refused.value.status == 404


@pytest.mark.anyio
async def test_store_turns_are_bounded_in_size(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path / 'records.db'}") as store:
        history = StoreHistory(store, ttl_s=60, max_turn_bytes=64)
        await history.put("resp_a", [{"text": "short"}], None, "call-a", {})
        await history.put("resp_b", [{"text": "x" * 100}], "resp_a", "call-b", {})  # over the bound: not kept
        assert await history.get("resp_a") == ([{"text": "short"}], "call-a")
        with pytest.raises(RequestRejectedError, match="'resp_b' is not held by this proxy"):
            await history.get("resp_b")


def test_the_model_list_fails_over_too(served: tuple[ProxyServer, str], fakes: list[FakeVLLM]) -> None:
    server, _ = served
    fakes[0].fail_next(503)
    fakes[1].fail_next(503)
    answer = httpx.get(server.base_url() + "/models")
    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "tiny"
    assert len(fakes[2].requests) == 1  # the one replica that answers was reached, whatever the order


@pytest.mark.anyio
async def test_a_store_chain_over_its_bound_is_refused_not_served_short(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path / 'records.db'}") as store:
        history = StoreHistory(store, ttl_s=60, max_chain_bytes=40)
        await history.put("resp_a", [{"text": "first turn"}], None, "call-a", {})
        await history.put("resp_b", [{"text": "second turn"}], "resp_a", "call-b", {})
        assert await history.get("resp_a") == ([{"text": "first turn"}], "call-a")
        with pytest.raises(RequestRejectedError, match="earlier turn 'resp_a' is no longer kept") as refused:
            await history.get("resp_b")  # 23 + 24 bytes: over 40 together
        assert refused.value.status == 404


@pytest.mark.anyio
async def test_an_answer_is_kept_beside_its_turn_in_memory_and_in_a_store(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path / 'records.db'}") as store:
        for history in (MemoryHistory(1), StoreHistory(store, ttl_s=60)):
            await history.put("resp_a", [{"a": 1}], None, "call-a", {"id": "resp_a", "output": [{"a": 1}]})
            assert await history.answer("resp_a") == {"id": "resp_a", "output": [{"a": 1}]}
            with pytest.raises(RequestRejectedError, match="response_id: 'resp_x' is not held") as refused:
                await history.answer("resp_x")
            assert refused.value.status == 404 and refused.value.param == "response_id"
