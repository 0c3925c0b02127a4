"""Several proxies, several upstreams, as deployed: ``python -m tokens.proxy`` processes over one record
store (PostgreSQL across machines, SQLite on one) in front of ``python -m tokens.testing.server`` replicas.

- Two proxies on one PostgreSQL store serve one Responses conversation that alternates between them
  (``previous_response_id`` from the other proxy each turn, streamed and whole); its records are
  complete, chained and exact.
- Three replicas behind two proxies: every turn of a rollout lands on one replica, whichever proxy
  it goes through; the record names it (``served_by``); rollouts spread over the replicas; when the
  rollout's replica is killed, its next turn is served by another and still captured exactly.
- A proxy killed in the middle of a stream leaves its call begun in the store: the rollout's
  snapshot is incomplete, as read by any other client.

Each fake replica answers with scripted ids whose log probabilities name it, so a record's ids say
which replica generated them, independently of the proxy's own ``served_by``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.postgres import fresh_database, running_postgres
from tests.served import started
from tokens.records import open_store
from tokens.testing import FakeTokenizer

TOKENIZER = FakeTokenizer()


def scripted(replica: int, index: int) -> tuple[list[int], list[float]]:
    """Replica ``replica``'s ``index``-th answer: the ids of ``r<replica> a<index>`` and log
    probabilities that name the replica."""
    ids = [*TOKENIZER.encode(f"r{replica} a{index}"), FakeTokenizer.IM_END]
    return ids, [-(replica + 1) / 8] * len(ids)


def replica_of(log_probs: list[float]) -> int:
    return round(-log_probs[0] * 8) - 1


def fake_server(stack: ExitStack, tmp_path: Path, replica: int, *, stream_delay: float = 0.0) -> tuple[str, Any]:
    script = tmp_path / f"replica-{replica}.json"
    replies = [dict(zip(("token_ids", "logprobs"), scripted(replica, index), strict=True)) for index in range(40)]
    script.write_text(json.dumps({"model": "tiny", "stream_delay_s": stream_delay, "replies": replies}))
    url, process = stack.enter_context(started(["-m", "tokens.testing.server", "--port", "0", "--script", str(script)]))
    return url, process


def proxy(stack: ExitStack, upstreams: list[str], store: str) -> str:
    options = [part for url in upstreams for part in ("--upstream", url)]
    url, _ = stack.enter_context(started(["-m", "tokens.proxy", *options, "--store", store, "--port", "0"]))
    return str(url)


def frozen(store_url: str, rollout: str) -> Any:
    async def freeze() -> Any:
        async with open_store(store_url) as store:
            return await store.freeze(rollout)

    return anyio.run(freeze)


@pytest.fixture(scope="module")
def postgres_cluster() -> Iterator[str]:
    with running_postgres() as url:
        yield url


def test_two_proxies_on_one_postgres_store_serve_one_responses_conversation(
    postgres_cluster: str, tmp_path: Path
) -> None:
    with fresh_database(postgres_cluster) as store_url, ExitStack() as stack:
        upstream, _ = fake_server(stack, tmp_path, 0)
        proxies = [proxy(stack, [upstream], store_url), proxy(stack, [upstream], store_url)]
        conversation: list[dict[str, str]] = []
        previous: str | None = None
        for turn in range(4):
            client = openai.OpenAI(base_url=f"{proxies[turn % 2]}/r/conv-1/v1", api_key="-", max_retries=0)
            asked: dict[str, Any] = {
                "model": "tiny",
                "input": f"question {turn}",
                "extra_headers": {"X-Model-Call-Id": f"turn-{turn}"},
            }
            if previous is not None:
                asked["previous_response_id"] = previous
            if turn % 2:  # streamed through the second proxy, whole through the first
                events = list(client.responses.create(stream=True, **asked))
                answer = next(event.response for event in events if event.type == "response.completed")
            else:
                answer = client.responses.create(**asked)
            ids, log_probs = scripted(0, turn)
            assert answer.output_text == f"r0 a{turn}"
            assert answer.output[-1].model_extra["generation_token_ids"] == ids
            conversation += [{"role": "user", "content": f"question {turn}"}]
            assert answer.output[-1].model_extra["prompt_token_ids"] == TOKENIZER.apply_chat_template(conversation)
            conversation += [{"role": "assistant", "content": answer.output_text}]
            previous = answer.id
        snapshot = frozen(store_url, "conv-1")
    assert not snapshot.incomplete
    records = {record.model_call_id: record for record in snapshot.entries}
    assert sorted(records) == [f"turn-{turn}" for turn in range(4)]
    for turn in range(4):
        record = records[f"turn-{turn}"]
        ids, log_probs = scripted(0, turn)
        assert record.generation_token_ids == ids and record.generation_log_probs == log_probs
        assert full_prompt_of(snapshot, record) == TOKENIZER.apply_chat_template(conversation[: 2 * turn + 1])
        assert record.parent_call_id == (None if turn == 0 else f"turn-{turn - 1}")
        assert record.served_by == upstream


def full_prompt_of(snapshot: Any, record: Any) -> list[int]:
    """The record's whole prompt, rebuilt through its parents in ``snapshot``."""
    if not record.prompt_is_delta:
        return list(record.prompt_token_ids)
    parent = next(entry for entry in snapshot.entries if entry.model_call_id == record.parent_call_id)
    return full_prompt_of(snapshot, parent) + list(parent.generation_token_ids) + list(record.prompt_token_ids)


def test_three_replicas_a_rollout_on_one_the_replica_recorded_and_failover(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'records.db'}"
    with ExitStack() as stack:
        servers = [fake_server(stack, tmp_path, replica) for replica in range(3)]
        urls = [url for url, _ in servers]
        proxies = [proxy(stack, urls, store_url), proxy(stack, urls, store_url)]
        answered = [0, 0, 0]  # answers each replica gave so far (its scripted answers go in order)
        conversations: dict[str, list[dict[str, str]]] = {}

        def turn(rollout: str, call: str, through: int, *, stream: bool = False) -> int:
            """One chat turn of ``rollout`` through proxy ``through``: the replica that generated it."""
            messages = conversations.setdefault(rollout, [])
            messages.append({"role": "user", "content": f"{call}?"})
            body = {"model": "tiny", "messages": messages, "stream": stream}
            headers = {"X-Model-Call-Id": call}
            url = f"{proxies[through]}/r/{rollout}/v1/chat/completions"
            if stream:
                with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
                    assert response.status_code == 200
                    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
                chunks = [json.loads(line) for line in lines]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
                generated = next(c["token_bundles"][0] for c in chunks if c.get("token_bundles"))
            else:
                response = httpx.post(url, json=body, headers=headers, timeout=60)
                assert response.status_code == 200, response.text
                message = response.json()["choices"][0]["message"]
                text, generated = message["content"], message
            replica = replica_of(generated["generation_log_probs"])
            assert (generated["generation_token_ids"], generated["generation_log_probs"]) == scripted(
                replica, answered[replica]
            )
            assert text == f"r{replica} a{answered[replica]}"
            answered[replica] += 1
            messages.append({"role": "assistant", "content": text})
            return replica

        served = [turn("main", f"main-{index}", index % 2, stream=index == 2) for index in range(4)]
        assert len(set(served)) == 1  # every turn on one replica, through either proxy
        home = served[0]
        spread = {turn(f"other-{index}", "only", index % 2) for index in range(12)}
        assert len(spread) > 1  # rollouts do not all land on one replica

        killed = servers[home][1]
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        after = [turn("main", f"main-{index}", index % 2, stream=index == 5) for index in range(4, 7)]
        assert home not in after and len(set(after)) == 1  # the next replica of its order, every turn

    snapshot = frozen(store_url, "main")
    assert not snapshot.incomplete
    records = {record.model_call_id: record for record in snapshot.entries}
    assert sorted(records) == [f"main-{index}" for index in range(7)]
    messages = conversations["main"]
    for index, replica in enumerate([*served, *after]):
        record = records[f"main-{index}"]
        assert record.served_by == urls[replica]
        assert replica_of(record.generation_log_probs) == replica
        assert full_prompt_of(snapshot, record) == TOKENIZER.apply_chat_template(messages[: 2 * index + 1])
        said = messages[2 * index + 1]["content"]
        assert record.generation_token_ids == [*TOKENIZER.encode(said), FakeTokenizer.IM_END]
    for index in range(12):
        (other,) = frozen(store_url, f"other-{index}").entries
        assert other.served_by == urls[replica_of(other.generation_log_probs)]


def test_a_proxy_killed_mid_stream_leaves_its_call_begun_in_the_store(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'records.db'}"
    with ExitStack() as stack:
        upstream, _ = fake_server(stack, tmp_path, 0, stream_delay=1.0)
        options = ["-m", "tokens.proxy", "--upstream", upstream, "--store", store_url, "--port", "0"]
        url, process = stack.enter_context(started(options))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream(
            "POST", f"{url}/r/cut/v1/chat/completions", json=body, headers={"X-Model-Call-Id": "c1"}, timeout=60
        ) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the stream has begun
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    snapshot = frozen(store_url, "cut")
    assert snapshot.incomplete and snapshot.entries == ()
