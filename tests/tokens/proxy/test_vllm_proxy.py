"""The proxy in front of the real vLLM server (CPU): the official SDKs as its clients, and the token
arrays it captures equal to the server's inline ids for the same request sent directly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tokens.proxy import ProxyServer, create_app

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it in Oslo?"}]
SAMPLING = {"max_tokens": 8, "temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def proxy(vllm_base_url: str) -> Iterator[ProxyServer]:
    with ProxyServer(create_app(vllm_base_url)) as server:
        yield server


@pytest.fixture(scope="module")
def direct(vllm_base_url: str) -> dict[str, Any]:
    """The server's own inline ids for the conversation, asked directly."""
    body = {"model": "tiny", "messages": MESSAGES, **SAMPLING, "return_token_ids": True, "logprobs": True}
    answer = httpx.post(vllm_base_url + "/chat/completions", json=body, timeout=120).json()
    return {
        "prompt_token_ids": answer["prompt_token_ids"],
        "generation_token_ids": answer["choices"][0]["token_ids"],
        "text": answer["choices"][0]["message"]["content"],
    }


def same(extra: dict[str, Any] | None, direct: dict[str, Any]) -> None:
    assert extra is not None
    assert extra["prompt_token_ids"] == direct["prompt_token_ids"]
    assert extra["generation_token_ids"] == direct["generation_token_ids"]
    assert len(extra["generation_log_probs"]) == len(direct["generation_token_ids"])
    assert all(value <= 0.0 for value in extra["generation_log_probs"])


def test_openai_chat(proxy: ProxyServer, direct: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=proxy.base_url("vllm-chat"), api_key="k", max_retries=0, timeout=120)
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, **SAMPLING)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == direct["text"]
    same(completion.choices[0].message.model_extra, direct)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **SAMPLING))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct["text"]
    same((chunks[-1].model_extra or {})["token_bundles"][0], direct)


def test_openai_responses(proxy: ProxyServer, direct: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=proxy.base_url("vllm-responses"), api_key="k", max_retries=0, timeout=120)
    request = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": "What time is it in Oslo?",
        "max_output_tokens": 8,
        "temperature": 0,
        "extra_body": {"seed": 1},
    }
    answer = client.responses.create(**request)  # through vLLM's /v1/responses: raw message tokens
    assert answer.output_text == direct["text"]
    same(answer.output[-1].model_extra, direct)
    events = list(client.responses.create(stream=True, **request))  # through chat completions: inline ids
    done = next(event for event in events if event.type == "response.completed")
    assert done.response.output_text == direct["text"]
    same(done.response.output[-1].model_extra, direct)


def test_anthropic_messages(proxy: ProxyServer, direct: dict[str, Any]) -> None:
    client = anthropic.Anthropic(
        base_url=proxy.base_url("vllm-messages").removesuffix("/v1"), api_key="k", max_retries=0, timeout=120
    )
    request: dict[str, Any] = {
        "model": "tiny",
        "system": "Be brief.",
        "messages": MESSAGES[1:],
        "max_tokens": 8,
        "extra_body": {"seed": 1, "temperature": 0},
    }
    message = client.messages.create(**request)
    assert message.content[0].type == "text" and message.content[0].text == direct["text"]
    same(message.model_extra, direct)
    with client.messages.stream(**request) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == direct["text"]
    same(deltas[0].model_extra, direct)


def test_legacy_completions_whole_and_streamed(proxy: ProxyServer, vllm_base_url: str) -> None:
    """``/v1/completions`` through the proxy, whole and streamed: the same ids and log probabilities as
    the server's own for the same request asked directly (temperature 0)."""
    request = {"model": "tiny", "prompt": "Once upon a time", **SAMPLING}
    asked = {**request, "return_token_ids": True, "logprobs": 0}
    own = httpx.post(vllm_base_url + "/completions", json=asked, timeout=120).json()["choices"][0]
    client = openai.OpenAI(base_url=proxy.base_url("vllm-legacy"), api_key="k", max_retries=0, timeout=120)
    whole = client.completions.create(**request).choices[0]  # type: ignore[call-overload]
    *chunks, final = client.completions.create(stream=True, **request)  # type: ignore[call-overload]
    [streamed] = (final.model_extra or {})["token_bundles"]
    for bundle in ((whole.model_extra or {}), streamed):
        assert bundle["prompt_token_ids"] == own["prompt_token_ids"]
        assert bundle["generation_token_ids"] == own["token_ids"]
        assert bundle["generation_log_probs"] == pytest.approx(own["logprobs"]["token_logprobs"], abs=1e-4)
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text == own["text"]
