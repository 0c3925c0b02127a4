"""The routes real clients call beside a model call, through the official SDKs: probes of the base URL,
a model by id, a kept Responses answer, exact token counts (the upstream's tokenizer through
``/tokenize``), legacy completions passed on with capture, and unknown endpoints answered in the
dialect of their path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.responses import Response

from pytest_llm_sandbox_middleware import CaptureProxy, running_capture_proxy
from tokens.proxy import messages_to_chat, responses_to_chat
from tokens.records import open_store, read_rollout
from tokens.testing import FakeTokenizer

TOKENIZER = FakeTokenizer()
USER = [{"role": "user", "content": "What time is it?"}]
TOOLS = [{"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def proxy() -> Iterator[CaptureProxy]:
    with running_capture_proxy() as proxy:
        yield proxy


def openai_client(proxy: CaptureProxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url("rollout-routes"), api_key="k", max_retries=0)


def anthropic_client(proxy: CaptureProxy) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url + "/r/rollout-routes", api_key="k", max_retries=0)


@pytest.mark.parametrize("path", ["", "/", "/v1", "/v1/", "/r/rollout-1", "/r/rollout-1/", "/r/rollout-1/v1"])
def test_the_base_urls_answer_probes(proxy: CaptureProxy, path: str) -> None:
    assert httpx.head(proxy.url + path).status_code == 200  # Claude Code's HEAD probe of its base URL
    assert httpx.get(proxy.url + path).status_code == 200


def test_head_on_a_served_route(proxy: CaptureProxy) -> None:
    for path in ("/v1/messages", "/r/r1/v1/responses", "/v1/chat/completions", "/v1/models"):
        assert httpx.head(proxy.url + path).status_code == 200
    assert httpx.head(proxy.url + "/v1/nothing").status_code == 404


def test_a_model_by_id_in_each_dialect(proxy: CaptureProxy) -> None:
    model = openai_client(proxy).models.retrieve("tiny")
    Model.model_validate(model.model_dump(), strict=True)
    assert model.id == "tiny"
    info = anthropic_client(proxy).models.retrieve("tiny")
    assert info.id == "tiny" and info.type == "model"
    with pytest.raises(openai.NotFoundError, match="not served"):
        openai_client(proxy).models.retrieve("huge")
    with pytest.raises(anthropic.NotFoundError, match="not served"):
        anthropic_client(proxy).models.retrieve("huge")


def test_a_kept_responses_answer_is_retrieved(proxy: CaptureProxy) -> None:
    client = openai_client(proxy)
    created = client.responses.create(model="tiny", input="What time is it?", max_output_tokens=64, tools=[])
    kept = client.responses.retrieve(created.id)
    Response.model_validate(kept.model_dump(mode="json", exclude_unset=True), strict=True)
    assert kept.id == created.id and kept.output_text == created.output_text
    assert "generation_token_ids" not in (kept.output[-1].model_extra or {})  # the record has the bundle
    with pytest.raises(openai.NotFoundError, match="previous_responses"):
        client.responses.retrieve("resp_gone")


def test_token_counts_are_the_upstream_tokenizer_s(proxy: CaptureProxy) -> None:
    request: dict[str, Any] = {"model": "tiny", "system": "Be brief.", "messages": USER, "tools": TOOLS}
    counted = anthropic_client(proxy).messages.count_tokens(**request)
    chat = messages_to_chat({**request, "max_tokens": 1})
    assert counted.input_tokens == len(TOKENIZER.apply_chat_template(chat["messages"], chat["tools"]))
    counted_in = openai_client(proxy).responses.input_tokens.count(
        model="tiny", input="What time is it?", instructions="Be brief."
    )
    chat = responses_to_chat({"model": "tiny", "input": "What time is it?", "instructions": "Be brief."})
    assert counted_in.input_tokens == len(TOKENIZER.apply_chat_template(chat["messages"]))
    assert proxy.fake.requests[-1][0] == "/tokenize"


def test_unknown_endpoints_answer_in_the_dialect_of_their_path(proxy: CaptureProxy) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        anthropic_client(proxy).messages.batches.list()
    assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client(proxy).files.list()
    assert missing.value.body["type"] == "not_found_error"  # type: ignore[index]


def test_legacy_completions_pass_with_capture(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    store = open_store(url)
    with running_capture_proxy(store=store) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("rollout-legacy"), api_key="k", max_retries=0)
        completion = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8)
        sent = proxy.fake.requests[-1][1]
    fields = completion.choices[0].model_extra or {}
    assert fields["prompt_token_ids"] == TOKENIZER.encode("Once upon")
    assert TOKENIZER.decode(fields["generation_token_ids"]) == completion.choices[0].text
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0

    async def read() -> Any:
        try:
            async with read_rollout(store, "rollout-legacy") as sample:
                return sample.records
        finally:
            await store.close()

    [record] = anyio.run(read)
    assert record.generation_token_ids == fields["generation_token_ids"]
    assert record.generation_log_probs == fields["generation_log_probs"]


def test_a_streamed_legacy_completion_passes_event_by_event_with_capture(tmp_path: Path) -> None:
    """``stream=True`` on ``/v1/completions`` (as vLLM serves it): every chunk passed on, the bundles on
    the final chunk (``token_bundles``), and the record the ids and log probabilities the chunks carried."""
    store = open_store(f"sqlite:///{tmp_path / 'records.db'}")
    with running_capture_proxy(store=store) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("rollout-legacy-stream"), api_key="k", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, stream=True))
        sent = proxy.fake.requests[-1][1]
    *tokens, final = chunks  # vLLM's own chunks pass as they came (its null finish_reason too); the proxy's:
    Completion.model_validate(final.model_dump(mode="json", exclude_unset=True), strict=True)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0
    [bundle] = (final.model_extra or {})["token_bundles"]
    generated = [token for chunk in tokens for token in (chunk.choices[0].model_extra or {})["token_ids"]]
    assert bundle["prompt_token_ids"] == TOKENIZER.encode("Once upon")
    assert bundle["generation_token_ids"] == generated and len(generated) == 8
    assert TOKENIZER.decode(generated) == "".join(chunk.choices[0].text for chunk in tokens)
    assert bundle["generation_log_probs"] == [
        lp
        for chunk in tokens
        for lp in chunk.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    ]

    async def read() -> Any:
        try:
            async with read_rollout(store, "rollout-legacy-stream") as sample:
                return sample.records, sample.trainable
        finally:
            await store.close()

    [record], trainable = anyio.run(read)
    assert trainable
    assert record.prompt_token_ids == bundle["prompt_token_ids"]
    assert record.generation_token_ids == generated
    assert record.generation_log_probs == bundle["generation_log_probs"]


def test_a_legacy_completion_s_stream_must_be_a_boolean(proxy: CaptureProxy) -> None:
    answer = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "stream": "yes"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"
