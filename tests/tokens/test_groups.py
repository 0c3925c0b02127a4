"""n > 1: one bundle per choice through every source, the prompt shared and checked once."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import openai
import pytest
import respx

import tokens
from tests.token_samples import BASE, CHAT, FIXTURES, INLINE, LOGPROBS_ONLY, TOKENIZE, TOKENIZED, sample
from tokens import ChoiceCountError, ConflictingTokenMetadataError, TokenCaptureTransport, TokenClient

pytestmark = pytest.mark.anyio

N2 = sample("chat_n2_inline_ids.response")
N2_REQUEST = sample("chat_n2_inline_ids.request")
SGLANG = json.loads((FIXTURES.parent / "sglang" / "chat_return_token_ids.response.json").read_text())
MESSAGES = [{"role": "user", "content": "hi"}]


def group(response: dict[str, Any], n: int) -> dict[str, Any]:
    """``response``'s first choice repeated ``n`` times, each with its own generation (ids shifted) and index."""
    grouped = copy.deepcopy(response)
    first = grouped["choices"][0]
    grouped["choices"] = []
    for index in range(n):
        choice = copy.deepcopy(first)
        choice["index"] = index
        if choice.get("token_ids"):
            choice["token_ids"] = [i + index for i in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        for entry in content:
            if entry["token"].startswith("token_id:"):
                entry["token"] = f"token_id:{int(entry['token'][9:]) + index}"
        grouped["choices"].append(choice)
    if "usage" in grouped:
        grouped["usage"]["completion_tokens"] *= n
    return grouped


async def complete(response: dict[str, Any], **body: Any) -> tuple[Any, int]:
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True, allow_tokenize_fallback=True) as client:
        with respx.mock(assert_all_called=False) as router:
            router.post(CHAT).mock(return_value=httpx.Response(200, json=response))
            tokenize = router.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
            n = len(response["choices"])
            completion = await client.chat_completion(**(body or {"model": "tiny", "messages": MESSAGES, "n": n}))
            return completion, tokenize.call_count


async def test_real_vllm_n2_response() -> None:
    """vLLM 0.32's n=2 answer: two bundles, the prompt ids shared (one list), each choice's own ids."""
    completion, tokenize_calls = await complete(N2, **{k: v for k, v in N2_REQUEST.items() if k != "logprobs"})
    first, second = completion.bundles
    assert first.prompt_token_ids is second.prompt_token_ids == N2["prompt_token_ids"]
    for bundle, choice, answer in zip(completion.bundles, N2["choices"], completion.response["choices"], strict=True):
        assert bundle.source == "vllm"
        assert bundle.generation_token_ids == choice["token_ids"]
        assert bundle.generation_log_probs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert answer["message"]["generation_token_ids"] is bundle.generation_token_ids
    assert completion.bundle is first and tokenize_calls == 0


async def test_usage_counts_every_choice() -> None:
    response = copy.deepcopy(N2)
    response["usage"]["completion_tokens"] = 3  # one choice's worth
    with pytest.raises(ConflictingTokenMetadataError, match=r"usage.completion_tokens is 3 .* 6 generated ids over 2"):
        await complete(response)


async def test_cross_checks_apply_per_choice() -> None:
    """Choice 1's inline ids against its own logprob ids, and each choice's message bundle against its inline ids."""
    response = group(INLINE, 3)
    response["choices"][1]["token_ids"][2] += 100
    with pytest.raises(ConflictingTokenMetadataError, match=r"choices\[1\]\.token_ids and the ids in choices\[1\]"):
        await complete(response)
    response = group(INLINE, 2)
    for choice in response["choices"]:
        choice["message"].update(
            prompt_token_ids=response["prompt_token_ids"],
            generation_token_ids=choice["token_ids"],
            generation_log_probs=[entry["logprob"] for entry in choice["logprobs"]["content"]],
        )
    completion, _ = await complete(response)
    assert [b.source for b in completion.bundles] == ["message", "message"]
    response["choices"][1]["message"]["generation_token_ids"] = response["choices"][0]["token_ids"]
    with pytest.raises(ConflictingTokenMetadataError, match="'message' source and the 'vllm' source"):
        await complete(response)


async def test_logprobs_fallback_calls_tokenize_once_for_the_group() -> None:
    completion, tokenize_calls = await complete(group(LOGPROBS_ONLY, 3))
    assert tokenize_calls == 1
    assert [b.source for b in completion.bundles] == ["tokenize"] * 3
    assert all(b.prompt_token_ids is completion.bundle.prompt_token_ids for b in completion.bundles)
    assert completion.bundles[2].generation_token_ids[0] == completion.bundles[0].generation_token_ids[0] + 2


async def test_sglang_choices_must_share_the_prompt() -> None:
    response = group(SGLANG, 2)
    completion, _ = await complete(response)
    assert [b.source for b in completion.bundles] == ["sglang", "sglang"]
    response["choices"][1]["prompt_token_ids"][0] += 1
    with pytest.raises(ConflictingTokenMetadataError, match=r"choices\[1\] has other prompt ids than choices\[0\]"):
        await complete(response)


async def test_sdk_n4_gives_four_bundles() -> None:
    """Through the OpenAI SDK: n=4 gives four choices, each message with its own exact ids."""
    response = group(INLINE, 4)
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    with respx.mock() as router:
        chat = router.post(CHAT).mock(return_value=httpx.Response(200, json=response))
        async with openai.AsyncOpenAI(
            base_url=BASE, api_key="-", http_client=httpx.AsyncClient(transport=transport)
        ) as client:
            completion = await client.chat.completions.create(model="tiny", messages=MESSAGES, n=4)  # type: ignore[arg-type]
    assert json.loads(chat.calls.last.request.content)["n"] == 4
    assert len(completion.choices) == 4
    for choice, sent in zip(completion.choices, response["choices"], strict=True):
        message: Any = choice.message
        assert message.generation_token_ids == sent["token_ids"]
        assert message.prompt_token_ids == response["prompt_token_ids"]


@pytest.mark.parametrize(("asked", "answered"), [(3, 1), (1, 2), (2, 3)])
async def test_a_group_of_another_size_than_n_is_a_typed_error(asked: int, answered: int) -> None:
    """n=K answered with another number of choices: ChoiceCountError naming both, through the client and the
    transport (a GRPO group of the wrong size would be a silent wrong answer)."""
    response = group(INLINE, answered)
    with pytest.raises(ChoiceCountError, match=f"asked for n={asked} choices but the response has {answered}") as info:
        await complete(response, model="tiny", messages=MESSAGES, n=asked)
    assert (info.value.requested, info.value.received) == (asked, answered)
    assert isinstance(info.value, tokens.TokenCaptureError)
    transport = TokenCaptureTransport(httpx.MockTransport(lambda request: httpx.Response(200, json=response)))
    async with httpx.AsyncClient(transport=transport) as http:
        with pytest.raises(ChoiceCountError):
            await http.post(CHAT, json={"model": "tiny", "messages": MESSAGES, "n": asked})


async def test_without_n_any_number_of_choices_is_accepted() -> None:
    completion, _ = await complete(group(INLINE, 2), model="tiny", messages=MESSAGES)
    assert len(completion.bundles) == 2
