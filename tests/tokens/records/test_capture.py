"""Capture writes records: coordinates by header or field (never sent upstream), the record put
before the response is handed back, parents resolved by lineage with delta prompts, failures
marked, the generate endpoint's weight-version spans recorded."""

from __future__ import annotations

import copy
import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tokens import (
    MalformedTokenMetadataError,
    ServerResponseError,
    TokenCaptureError,
    TokenCaptureTransport,
    TokenClient,
    Trajectory,
    UnsupportedRequestError,
    WeightVersionSpan,
)
from tokens.records import (
    CoordinateError,
    Coordinates,
    RecordStore,
    RecordWriteError,
    RolloutFrozenError,
    open_store,
    read_rollout,
    weight_spans,
)
from tokens.testing import FakeVLLM

pytestmark = pytest.mark.anyio

BASE = "http://vllm.test:8000/v1"
GENERATE = json.loads((Path(__file__).parent / "generate_sample.json").read_text())


class Upstream:
    """The fake vLLM server, keeping each request's headers and body as the server got them."""

    def __init__(self, *replies: str) -> None:
        self.fake = FakeVLLM(replies=replies)
        self.seen: list[tuple[httpx.Headers, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.headers, json.loads(request.content or b"null")))
        return self.fake(request)


@pytest.fixture
async def store(sqlite_url: str) -> Any:
    async with open_store(sqlite_url) as opened:
        yield opened


def sdk(upstream: Upstream, store: Any, **options: Any) -> openai.AsyncOpenAI:
    transport = TokenCaptureTransport(
        httpx.MockTransport(upstream), request_prompt_and_generation_token_ids=True, sink=store, **options
    )
    return openai.AsyncOpenAI(base_url=BASE, api_key="k", http_client=httpx.AsyncClient(transport=transport))


async def test_sdk_headers_record_turns_the_server_never_sees(store: RecordStore, sqlite_url: str) -> None:
    """Two turns through the OpenAI SDK with coordinate headers: neither header nor field reaches the
    server; each record is readable by a fresh client as soon as the call returns; the second
    resolves the first as its parent and stores only its new prompt tokens."""
    upstream = Upstream("It is sunny.", "Rain tomorrow.")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    turns = []
    async with sdk(upstream, store, weight_version="step-3") as client:
        for call, follow_up in (("call-1", "And tomorrow?"), ("call-2", None)):
            completion = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=32,
                extra_headers={"X-Rollout-Id": "rollout-7", "X-Model-Call-Id": call},
            )
            async with open_store(sqlite_url) as fresh:  # put before the response was handed back
                assert call in [r.model_call_id for r in await fresh.records("rollout-7")]
            message: Any = completion.choices[0].message
            turns.append(message)
            if follow_up:
                messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": follow_up}]
    for headers, body in upstream.seen:
        assert not {"x-rollout-id", "x-model-call-id"} & set(headers.keys())
        assert not {"rollout_id", "model_call_id", "parent_call_id", "weight_version"} & set(body)
    first, second = await store.records("rollout-7")
    assert (first.parent_resolution, second.parent_resolution, second.parent_call_id) == ("root", "resolved", "call-1")
    assert second.prompt_is_delta and first.prompt_token_ids == turns[0].prompt_token_ids
    assert first.prompt_token_ids + first.generation_token_ids + second.prompt_token_ids == turns[1].prompt_token_ids
    assert second.generation_token_ids == turns[1].generation_token_ids
    assert weight_spans(second) == (WeightVersionSpan("step-3", 0, len(turns[1].generation_token_ids)),)
    assert (
        second.output_items[0]["content"] == "Rain tomorrow." and "generation_token_ids" not in second.output_items[0]
    )
    assert (
        second.response_id
        and second.digest
        and second.cum_len == len(turns[1].prompt_token_ids) + len(turns[1].generation_token_ids)
    )


async def test_body_fields_and_the_client_rebuild_the_same_trajectory(store: RecordStore) -> None:
    """TokenClient with top-level fields; read_rollout's trajectory equals the one built in memory,
    and the rollout is dropped after."""
    upstream = Upstream("one", "two", "three")
    messages: list[Any] = [{"role": "user", "content": "count"}]
    memory = Trajectory()
    async with TokenClient(
        BASE,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)),
        request_prompt_and_generation_token_ids=True,
        sink=store,
    ) as client:
        for turn in range(3):
            completion = await client.chat_completion(
                model="tiny", messages=messages, rollout_id="r", model_call_id=f"c{turn}", weight_version=turn
            )
            memory.add(completion)
            text = completion.response["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    assert all("rollout_id" not in body and "weight_version" not in body for _, body in upstream.seen)
    async with read_rollout(store, "r") as sample:
        assert sample.trainable and sample.segments == memory.segments and len(sample.records) == 3
        assert [weight_spans(r)[0].version for r in sample.records] == ["0", "1", "2"]
    assert sample.dropped
    assert (await store.rollouts())[0].retired


async def test_explicit_parent_header_and_a_missing_one(store: RecordStore) -> None:
    upstream = Upstream("first", "second")
    async with sdk(upstream, store) as client:
        first: Any = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a"}],
            extra_body={"rollout_id": "r", "model_call_id": "a"},
        )
        rewritten = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "FIRST, REWORDED"}]
        await client.chat.completions.create(
            model="tiny",
            messages=rewritten,  # type: ignore[arg-type]
            extra_headers={"X-Rollout-Id": "r", "X-Model-Call-Id": "b", "X-Parent-Call-Id": "a"},
        )
        await client.chat.completions.create(
            model="tiny",
            messages=rewritten,  # type: ignore[arg-type]
            extra_headers={"X-Rollout-Id": "r", "X-Model-Call-Id": "c", "X-Parent-Call-Id": "ghost"},
        )
    by_id = {r.model_call_id: r for r in await store.records("r")}
    assert by_id["b"].parent_call_id == "a" and by_id["b"].parent_resolution_reason == "parent_call_id"
    assert first.choices[0].message.generation_token_ids
    assert (
        by_id["c"].parent_resolution == "unresolved" and "'ghost' has no record" in by_id["c"].parent_resolution_reason
    )
    async with read_rollout(store, "r") as sample:
        assert not sample.trainable and "parent unresolved" in sample.notes[0]
    assert sample.dropped  # the consumer decides; dropping what it masked is its call


async def test_refusals_before_anything_is_sent(store: RecordStore) -> None:
    upstream = Upstream()
    async with sdk(upstream, store) as client:
        create = client.chat.completions.create
        messages: Any = [{"role": "user", "content": "a"}]
        with pytest.raises(UnsupportedRequestError, match="the header says 'x', the body 'y'"):
            await create(
                model="tiny", messages=messages, extra_headers={"X-Rollout-Id": "x"}, extra_body={"rollout_id": "y"}
            )
        with pytest.raises(UnsupportedRequestError, match="n=2 with a rollout id"):
            await create(model="tiny", messages=messages, n=2, extra_body={"rollout_id": "r"})
        with pytest.raises(UnsupportedRequestError, match="without a rollout id"):
            await create(model="tiny", messages=messages, extra_headers={"X-Model-Call-Id": "c"})
        with pytest.raises(UnsupportedRequestError, match="stream=true with a rollout id"):
            await create(model="tiny", messages=messages, stream=True, extra_body={"rollout_id": "r"})
        await store.freeze("frozen")
        with pytest.raises(RolloutFrozenError, match="nothing was sent"):
            await create(model="tiny", messages=messages, extra_body={"rollout_id": "frozen"})
        assert upstream.seen == []
        await create(model="tiny", messages=messages)  # no rollout id: captured, not recorded
    assert [r.rollout_id for r in await store.rollouts()] == ["frozen"]


@pytest.mark.parametrize("value", ["a b", "r/../x", "x" * 201, "", "é"])
async def test_one_id_rule_for_every_front_end(store: RecordStore, value: str) -> None:
    """An id that could not travel in a header or a URL is refused by the client and the transport
    alike (``CoordinateError``, naming the field), before anything is sent."""
    upstream = Upstream()
    messages: Any = [{"role": "user", "content": "a"}]
    async with TokenClient(
        BASE, http_client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)), sink=store
    ) as client:
        with pytest.raises(CoordinateError, match=r"model_call_id: .* is not an id") as raised:
            await client.chat_completion(model="tiny", messages=messages, rollout_id="r", model_call_id=value)
        assert raised.value.where == "model_call_id"
    async with sdk(upstream, store) as sdk_client:
        with pytest.raises(UnsupportedRequestError, match=r"rollout_id: .* is not an id"):
            await sdk_client.chat.completions.create(model="tiny", messages=messages, extra_body={"rollout_id": value})
    assert upstream.seen == []
    with pytest.raises(CoordinateError, match="parent_call_id"):
        Coordinates("r", "c", value)


class BrokenUpstream:
    """The fake vLLM with its answers' token ids dropped (a capture failure), or never answering."""

    def __init__(self, *, hang: bool = False) -> None:
        self.fake = FakeVLLM()
        self.hang = hang

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.hang:
            await anyio.sleep_forever()
        answer = json.loads(self.fake(request).content)
        answer["choices"][0]["token_ids"] = None
        answer["choices"][0]["logprobs"] = None
        return httpx.Response(200, json=answer)


async def test_a_capture_failure_or_a_cancellation_marks_the_call_and_an_http_error_does_not(
    store: RecordStore,
) -> None:
    """The call's custody: a capture failure, or a cancellation before the record, marks the rollout
    incomplete; the server's own HTTP error leaves the call begun, for a retry to complete."""
    messages: Any = [{"role": "user", "content": "a"}]

    def client(handler: Any) -> TokenClient:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return TokenClient(BASE, http_client=http, sink=store, retry=None, request_prompt_and_generation_token_ids=True)

    async with client(BrokenUpstream()) as broken:
        with pytest.raises(TokenCaptureError):
            await broken.chat_completion(model="tiny", messages=messages, rollout_id="failed", model_call_id="c")
    async with client(BrokenUpstream(hang=True)) as hanging:
        with anyio.move_on_after(0.2):
            await hanging.chat_completion(model="tiny", messages=messages, rollout_id="cancelled", model_call_id="c")
    async with client(lambda request: httpx.Response(500, json={"error": "busy"})) as failing:
        with pytest.raises(ServerResponseError):
            await failing.chat_completion(model="tiny", messages=messages, rollout_id="http", model_call_id="c")
    states = {summary.rollout_id: summary for summary in await store.rollouts()}
    assert states["failed"].incomplete and states["cancelled"].incomplete
    assert not states["http"].incomplete


class FailingSink:
    """A sink whose put fails; its mark_incomplete fails too when ``marks_fail``."""

    def __init__(self, *, marks_fail: bool) -> None:
        self.marks_fail = marks_fail
        self.marked: list[tuple[str, str]] = []

    async def put(self, entry: Any) -> None:
        raise OSError("disk full")

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        if self.marks_fail:
            raise OSError("disk still full")
        self.marked.append((rollout_id, model_call_id))

    async def close(self) -> None:
        pass


async def test_a_failed_put_marks_the_rollout_and_a_failed_mark_fails_the_call(caplog: Any) -> None:
    sink = FailingSink(marks_fail=False)
    upstream = Upstream()
    async with sdk(upstream, sink) as client:
        completion: Any = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a"}],
            extra_body={"rollout_id": "r", "model_call_id": "c"},
        )
    assert completion.choices[0].message.generation_token_ids and sink.marked == [("r", "c")]
    assert "marked incomplete" in caplog.text
    async with sdk(upstream, FailingSink(marks_fail=True)) as client:
        with pytest.raises(RecordWriteError, match="could not be marked incomplete"):
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "a"}], extra_body={"rollout_id": "r"}
            )
    with pytest.raises(TypeError, match="has no put"):
        TokenClient(BASE, sink=object())


async def test_a_failed_parent_lookup_records_the_call_unresolved(
    store: RecordStore, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The store's lineage lookup raising (a locked database, a corrupt chain) is a capture error:
    the model call still answers and its record says why it has no parent (it raised the store's
    own sqlite3 error into the model call)."""

    async def locked(*args: Any) -> Any:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(store, "resolve", locked)
    async with sdk(Upstream("first"), store) as client:
        completion: Any = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a"}],
            extra_body={"rollout_id": "r", "model_call_id": "c"},
        )
    assert completion.choices[0].message.generation_token_ids
    (record,) = await store.records("r")
    assert record.parent_resolution == "unresolved"
    assert record.parent_resolution_reason == "lineage_lookup_failed: OperationalError"
    assert "the parent lookup failed" in caplog.text


def generate_server(spans: list[Any] | None = None) -> tuple[httpx.MockTransport, list[Any]]:
    """/inference/v1/generate answering the recorded vLLM body, for any prompt (echoed back)."""
    seen: list[Any] = []

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/inference/v1/generate"
        body = json.loads(request.content)
        seen.append(body)
        answer = copy.deepcopy(GENERATE["response"])
        answer["prompt_token_ids"] = body["token_ids"]
        if spans is not None:
            answer["choices"][0]["weight_versions"] = spans
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handle), seen


async def test_generate_carries_weight_version_spans_into_bundle_and_record(store: RecordStore) -> None:
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 5}]
    transport, seen = generate_server(spans)
    generated = GENERATE["response"]["choices"][0]["token_ids"]
    async with TokenClient(BASE, http_client=httpx.AsyncClient(transport=transport), sink=store) as client:
        first = await client.generate(
            [1, 2, 3, 4], sampling_params={"max_tokens": 5}, rollout_id="r", model_call_id="g1"
        )
        second = await client.generate(
            [1, 2, 3, 4, *generated, 9], sampling_params={"max_tokens": 5}, rollout_id="r", model_call_id="g2"
        )
    assert seen[0] == {
        "sampling_params": {"max_tokens": 5, "logprobs": 0},
        "token_ids": [1, 2, 3, 4],
        "return_token_ids": True,
    }
    assert first.bundle.generation_token_ids == generated
    assert first.bundle.weight_versions == (WeightVersionSpan("v1", 0, 2), WeightVersionSpan("v2", 2, 5))
    expected = [c["logprob"] for c in GENERATE["response"]["choices"][0]["logprobs"]["content"]]
    assert first.bundle.generation_log_probs == expected
    g1, g2 = await store.records("r")
    assert weight_spans(g1) == first.bundle.weight_versions
    assert (g2.parent_call_id, g2.prompt_is_delta, g2.prompt_token_ids) == ("g1", True, [9])  # found by prefix digest
    assert second.bundle.prompt_token_ids == [1, 2, 3, 4, *generated, 9]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "v1", "start": 0, "end": 4}],
        [{"version": "v1", "start": 1, "end": 5}],
        [{"version": 3, "start": 0, "end": 5}],
        "v1",
    ],
)
async def test_generate_refuses_spans_that_do_not_tile_the_generation(spans: Any) -> None:
    transport, _ = generate_server(spans)
    async with TokenClient(BASE, http_client=httpx.AsyncClient(transport=transport)) as client:
        with pytest.raises(MalformedTokenMetadataError, match="weight_versions"):
            await client.generate([1, 2, 3, 4], sampling_params={"max_tokens": 5})
