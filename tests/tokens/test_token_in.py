"""Token-in completions: /v1/completions with the prompt as ids, the echo checked, a Trajectory continued."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import respx

from tests.token_samples import BASE, sample
from tokens import ChoiceCountError, ConflictingTokenMetadataError, MissingTokenMetadataError, TokenClient, Trajectory
from tokens.testing import FAKE_VLLM_URL, FakeTokenizer, FakeVLLM

pytestmark = pytest.mark.anyio

RECORDED = sample("completions_token_in.response")
SENT = sample("completions_token_in.request")["prompt"]
V1 = FAKE_VLLM_URL + "/v1"


async def token_in(answer: dict[str, object], prompt: list[int]) -> object:
    async with TokenClient(BASE, retry=None) as client:
        with respx.mock() as router:
            route = router.post(BASE + "/completions").mock(return_value=httpx.Response(200, json=answer))
            completion = await client.completion(prompt, max_tokens=3)
    sent = json.loads(route.calls.last.request.content)
    assert sent["prompt"] == prompt and sent["return_token_ids"] is True and sent["logprobs"] == 0
    return completion


async def test_recorded_vllm_answer() -> None:
    completion = await token_in(RECORDED, SENT)
    bundle = completion.bundle  # type: ignore[attr-defined]
    assert bundle.prompt_token_ids == SENT
    assert bundle.generation_token_ids == RECORDED["choices"][0]["token_ids"]
    assert bundle.generation_log_probs == RECORDED["choices"][0]["logprobs"]["token_logprobs"]


async def test_echoed_prompt_must_equal_what_was_sent() -> None:
    answer = copy.deepcopy(RECORDED)
    answer["choices"][0]["prompt_token_ids"][4] = 7
    with pytest.raises(ConflictingTokenMetadataError, match=r"differs from the ids sent at index 4 \(79 vs 7\)"):
        await token_in(answer, SENT)
    del answer["choices"][0]["prompt_token_ids"]
    with pytest.raises(MissingTokenMetadataError, match="return_token_ids=true"):
        await token_in(answer, SENT)


async def test_trajectory_drives_token_in_turns(fake_vllm: FakeVLLM) -> None:
    """Turn 1 as a chat completion, turn 2 sent as ids (the previous prompt + generation + the new user turn)."""
    tokenizer = FakeTokenizer()
    fake_vllm.reply("It is noon.", "Yes.")
    trajectory = Trajectory(boundary_token_ids={FakeTokenizer.IM_END})
    async with TokenClient(V1, request_prompt_and_generation_token_ids=True) as client:
        first = await client.chat_completion(model="tiny", messages=[{"role": "user", "content": "Time?"}])
        assert trajectory.add(first) is None
        prefix = trajectory.required_prefix_token_ids
        assert prefix is not None and prefix[-1] == FakeTokenizer.IM_END
        user = [
            *tokenizer.encode("\n"),
            FakeTokenizer.IM_START,
            *tokenizer.encode("user\nSure?"),
            FakeTokenizer.IM_END,
            *tokenizer.encode("\n"),
            FakeTokenizer.IM_START,
            *tokenizer.encode("assistant\n"),
        ]
        second = await client.completion([*prefix, *user], model="tiny", max_tokens=16)
    assert trajectory.add(second) is None and trajectory.drifts == []
    [segment] = trajectory.segments
    assert tokenizer.decode(segment.token_ids).endswith("assistant\nYes.<|im_end|>")
    assert sum(segment.loss_mask) == len(first.bundle.generation_token_ids) + len(second.bundle.generation_token_ids)


async def test_a_token_in_group_of_another_size_than_n_is_a_typed_error() -> None:
    async with TokenClient(BASE, retry=None) as client:
        with respx.mock() as router:
            router.post(BASE + "/completions").mock(return_value=httpx.Response(200, json=RECORDED))
            with pytest.raises(ChoiceCountError, match="asked for n=2 choices but the response has 1"):
                await client.completion(SENT, max_tokens=3, n=2)
