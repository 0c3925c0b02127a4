"""Token capture against a real vLLM server (CPU build) on a tiny random model made at test time."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.token_samples import FIXTURES, keys
from tokens import TokenCaptureTransport, TokenClient, Trajectory
from tokens.testing import FAKE_VLLM_URL, FakeVLLM

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

REQUEST = json.loads((FIXTURES / "chat_inline_ids.request.json").read_text())
MESSAGES = REQUEST["messages"]
TOOLS = REQUEST["tools"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Counting:
    """An httpx client that counts the requests it sends, by path."""

    def __init__(self) -> None:
        self.paths: list[str] = []

        async def record(request: httpx.Request) -> None:
            self.paths.append(request.url.path)

        self.client = httpx.AsyncClient(timeout=120, event_hooks={"request": [record]})


async def tokenize(base_url: str, **body: Any) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(base_url.removesuffix("/v1") + "/tokenize", json={"model": "tiny", **body})
        response.raise_for_status()
        tokens: list[int] = response.json()["tokens"]
        return tokens


async def test_inline_ids_equal_tokenize_in_one_request(vllm_base_url: str) -> None:
    """With inline ids requested, the prompt ids equal /tokenize's and exactly one request is made."""
    counting = Counting()
    async with (
        counting.client,
        TokenClient(vllm_base_url, http_client=counting.client, request_prompt_and_generation_token_ids=True) as client,
    ):
        completion = await client.chat_completion(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1)
    assert completion.bundle.source == "vllm"
    assert counting.paths == ["/v1/chat/completions"]
    assert completion.bundle.prompt_token_ids == await tokenize(vllm_base_url, messages=MESSAGES, tools=TOOLS)
    assert len(completion.bundle.generation_token_ids) == len(completion.bundle.generation_log_probs) > 0
    assert all(lp <= 0.0 for lp in completion.bundle.generation_log_probs)


async def test_fallback_gives_the_same_prompt_ids(vllm_base_url: str) -> None:
    """Without inline ids, logprobs plus /tokenize reproduce the same prompt and generation."""
    counting = Counting()
    async with counting.client, TokenClient(vllm_base_url, http_client=counting.client) as client:
        fallback = await client.chat_completion(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1)
    async with TokenClient(vllm_base_url, request_prompt_and_generation_token_ids=True) as client:
        inline = await client.chat_completion(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1)
    assert fallback.bundle.source == "tokenize"
    assert counting.paths == ["/v1/chat/completions", "/tokenize"]
    assert fallback.bundle.prompt_token_ids == inline.bundle.prompt_token_ids
    assert fallback.bundle.generation_token_ids == inline.bundle.generation_token_ids


async def test_generation_ids_decode_to_the_text(vllm_base_url: str) -> None:
    """The generated ids detokenize to exactly the returned message text."""
    async with TokenClient(vllm_base_url, request_prompt_and_generation_token_ids=True) as client:
        completion = await client.chat_completion(
            model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=12, seed=3
        )
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            vllm_base_url.removesuffix("/v1") + "/detokenize",
            json={"model": "tiny", "tokens": completion.bundle.generation_token_ids},
        )
    assert response.json()["prompt"] == completion.response["choices"][0]["message"]["content"]


async def test_second_turn_with_the_first_answer(vllm_base_url: str) -> None:
    """A second turn that feeds the first answer back gets its own exact prompt ids."""
    async with TokenClient(vllm_base_url, request_prompt_and_generation_token_ids=True) as client:
        first = await client.chat_completion(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6, seed=1)
        answer = first.response["choices"][0]["message"]
        turn2 = [
            *MESSAGES,
            {"role": "assistant", "content": answer["content"] or ""},
            {"role": "user", "content": "And in Lima?"},
        ]
        second = await client.chat_completion(model="tiny", messages=turn2, tools=TOOLS, max_tokens=6, seed=1)
    assert second.bundle.source == "vllm"
    assert second.bundle.prompt_token_ids == await tokenize(vllm_base_url, messages=turn2, tools=TOOLS)
    assert len(second.bundle.prompt_token_ids) > len(first.bundle.prompt_token_ids)
    assert second.bundle.prompt_token_ids[: len(first.bundle.prompt_token_ids)] == first.bundle.prompt_token_ids


async def test_three_turns_through_a_trajectory(vllm_base_url: str) -> None:
    """Three real turns: the trajectory's verdict (drift or not, and where) equals a direct comparison."""
    end_of_turn = (await tokenize(vllm_base_url, prompt="<|im_end|>", add_special_tokens=False))[0]
    trajectory = Trajectory(policy="split", boundary_token_ids={end_of_turn})
    messages = list(MESSAGES)
    bundles = []
    async with TokenClient(vllm_base_url, request_prompt_and_generation_token_ids=True) as client:
        for turn, follow_up in enumerate(["And in Lima?", "And in Tokyo?", None]):
            completion = await client.chat_completion(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=6, seed=turn
            )
            drift = trajectory.add(completion)
            bundles.append(completion.bundle)
            if turn:
                previous = bundles[-2]
                expected = previous.prompt_token_ids + previous.generation_token_ids
                actual = completion.bundle.prompt_token_ids
                direct = next((i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b), None)
                if direct is None and len(actual) < len(expected):
                    direct = len(actual)
                # A generated end-of-turn token re-rendered by the template as itself is tolerated, not drift.
                if direct == len(expected) - 1 and expected[-1] == end_of_turn and actual[direct:][:1] == [end_of_turn]:
                    direct = None
                assert (drift.index if drift is not None else None) == direct
            if follow_up is not None:
                answer = completion.response["choices"][0]["message"]["content"] or ""
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    assert sum(s.turns for s in trajectory.segments) == 3
    assert len(trajectory.segments) == 1 + len(trajectory.drifts)
    for segment in trajectory.segments:
        assert len(segment.token_ids) == len(segment.loss_mask) == len(segment.log_probs)


async def detokenize(base_url: str, ids: list[int]) -> str:
    """The text of ``ids`` by /detokenize, without the replacement character /detokenize writes for a
    character cut in half by max_tokens (the server's own text holds that partial character back)."""
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            base_url.removesuffix("/v1") + "/detokenize", json={"model": "tiny", "tokens": ids}
        )
        response.raise_for_status()
        text: str = response.json()["prompt"]
        return text.removesuffix("\ufffd")


def sdk(base_url: str) -> openai.AsyncOpenAI:
    transport = TokenCaptureTransport(request_prompt_and_generation_token_ids=True)
    return openai.AsyncOpenAI(base_url=base_url, api_key="-", http_client=httpx.AsyncClient(transport=transport))


async def test_sdk_n2_through_the_transport(vllm_base_url: str) -> None:
    """The OpenAI SDK with n=2: each choice's generation ids detokenize to its content; prompt ids equal /tokenize."""
    async with sdk(vllm_base_url) as client:
        completion = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6, n=2, seed=5, temperature=1.0
        )
    prompt = await tokenize(vllm_base_url, messages=MESSAGES, tools=TOOLS)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        message: Any = choice.message
        assert message.prompt_token_ids == prompt
        assert len(message.generation_token_ids) == len(message.generation_log_probs) > 0
        assert await detokenize(vllm_base_url, message.generation_token_ids) == (message.content or "")


async def test_sdk_stream_through_the_transport(vllm_base_url: str) -> None:
    """A real stream through the SDK: every chunk, then the bundle on the final chunk, matching the text."""
    async with sdk(vllm_base_url) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1, stream=True
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    final = chunks[-1].model_extra or {}
    [bundle] = final["token_bundles"]
    assert bundle["prompt_token_ids"] == await tokenize(vllm_base_url, messages=MESSAGES, tools=TOOLS)
    assert len(bundle["generation_token_ids"]) == len(bundle["generation_log_probs"]) == 8
    assert await detokenize(vllm_base_url, bundle["generation_token_ids"]) == text


async def test_token_in_continues_a_two_turn_trajectory(vllm_base_url: str) -> None:
    """Turn 2 sent as ids (turn 1's prompt + generation + the rendered next user turn): no drift, echo equal."""
    end_of_turn = (await tokenize(vllm_base_url, prompt="<|im_end|>", add_special_tokens=False))[0]
    next_turn = await tokenize(
        vllm_base_url,
        prompt="\n<|im_start|>user\nAnd in Lima?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    trajectory = Trajectory(boundary_token_ids={end_of_turn})
    async with TokenClient(vllm_base_url, request_prompt_and_generation_token_ids=True) as client:
        first = await client.chat_completion(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6, seed=1)
        assert trajectory.add(first) is None
        prefix = trajectory.required_prefix_token_ids
        assert prefix is not None
        closing = [] if prefix[-1] == end_of_turn else [end_of_turn]  # a length-cut answer gets its end token
        second = await client.completion([*prefix, *closing, *next_turn], model="tiny", max_tokens=6, seed=1)
    assert second.bundle.prompt_token_ids == [*prefix, *closing, *next_turn]
    assert trajectory.add(second) is None and trajectory.drifts == []
    assert await detokenize(vllm_base_url, second.bundle.generation_token_ids) == second.response["choices"][0]["text"]


FIELD_SET_REQUESTS = [
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "n": 2, "logprobs": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4000}),
    ("/v1/completions", {"prompt": [1, 100, 101, 102], "max_tokens": 3, "logprobs": 0, "return_token_ids": True}),
    ("/v1/completions", {"prompt": [1, 10**6], "max_tokens": 3}),
    ("/tokenize", {"messages": MESSAGES, "tools": TOOLS}),
    ("/detokenize", {"tokens": [100, 101, 102]}),
]


FIELD_SET_IDS = ["chat", "chat-n2", "error", "token-in", "token-in-error", "tokenize", "detokenize"]


@pytest.mark.parametrize(("path", "body"), FIELD_SET_REQUESTS, ids=FIELD_SET_IDS)
async def test_fake_vllm_field_sets_equal_the_real_server(vllm_base_url: str, path: str, body: dict[str, Any]) -> None:
    """tokens.testing.FakeVLLM answers with exactly the fields the real server sends, at every level."""
    request = {"model": "tiny", "seed": 1, **body}
    async with httpx.AsyncClient(timeout=120) as http:
        real = await http.post(vllm_base_url.removesuffix("/v1") + path, json=request)
    fake = FakeVLLM()(httpx.Request("POST", FAKE_VLLM_URL + path, json=request))
    assert fake.status_code == real.status_code
    assert keys(fake.json()) == keys(real.json())


async def test_fake_vllm_stream_field_sets_equal_the_real_server(vllm_base_url: str) -> None:
    request = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream": True,
        "seed": 1,
        "logprobs": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=120) as http:
        real = await http.post(vllm_base_url + "/chat/completions", json=request)
    fake = FakeVLLM()(httpx.Request("POST", FAKE_VLLM_URL + "/v1/chat/completions", json=request))

    def chunks(data: bytes) -> list[Any]:
        return [keys(json.loads(event[6:])) for event in data.split(b"\n\n") if event.startswith(b"data: {")]

    # The first and the final (usage) chunk have fixed fields; a token chunk's depend on the text (the
    # server leaves out a delta's content while it holds back a partial character): each of the
    # fake's token-chunk shapes must be one the server sent.
    fake_chunks, real_chunks = chunks(fake.content), chunks(real.content)
    assert (fake_chunks[0], fake_chunks[-1]) == (real_chunks[0], real_chunks[-1])
    assert all(shape in real_chunks[1:-1] for shape in fake_chunks[1:-1])
