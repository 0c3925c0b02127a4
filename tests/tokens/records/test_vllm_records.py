"""Records against the real vLLM server (CPU build, tiny random model), started once with
``--enable-scale-out`` and dev mode (``VLLM_SERVER_DEV_MODE=1``): a multi-turn chat rollout's
records equal the server's inline ids exactly and rebuild the in-memory trajectory; a token-in
rollout whose weight version changes between turns records each turn's spans as the server
reported them. Run under ``flock /work/wt/vllm.lock`` on a shared machine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.vllm.server import require_vllm_python, running_server
from tokens import TokenBundle, TokenCaptureTransport, TokenClient, Trajectory, WeightVersionSpan
from tokens.records import open_store, order_records, read_rollout, weight_spans

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def scale_out_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("vllm-scale-out")
    with running_server(
        require_vllm_python(), workdir, extra_args=["--enable-scale-out"], extra_env={"VLLM_SERVER_DEV_MODE": "1"}
    ) as url:
        yield url


class Recording(httpx.AsyncBaseTransport):
    """The real transport, keeping every answer body as the server sent it."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[Any] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        data = await response.aread()
        self.bodies.append(json.loads(data))
        return httpx.Response(response.status_code, headers=response.headers, content=data)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_multi_turn_chat_records_equal_the_servers_inline_ids(scale_out_url: str, tmp_path: Path) -> None:
    recording = Recording()
    store = open_store(f"sqlite:///{tmp_path}/r.db")
    transport = TokenCaptureTransport(
        recording, request_prompt_and_generation_token_ids=True, sink=store, weight_version="step-0"
    )
    client = openai.AsyncOpenAI(base_url=scale_out_url, api_key="k", http_client=httpx.AsyncClient(transport=transport))
    messages: list[Any] = [{"role": "user", "content": "Tell me a story."}]
    memory = Trajectory(policy="split")
    async with client:
        for turn in range(3):
            completion = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=12,
                temperature=0.0,
                extra_headers={"X-Rollout-Id": "chat-rollout", "X-Model-Call-Id": f"turn-{turn}"},
            )
            message: Any = completion.choices[0].message
            memory.add(
                TokenBundle(
                    message.prompt_token_ids, message.generation_token_ids, message.generation_log_probs, "vllm"
                )
            )
            messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "Go on."}]
    async with store, read_rollout(store, "chat-rollout", policy="split") as sample:
        assert [r.model_call_id for r in sample.records] == ["turn-0", "turn-1", "turn-2"]
        prompts = [bundle.prompt_token_ids for _, bundle in order_records(sample.snapshot.entries)]
        for record, raw, rebuilt in zip(sample.records, recording.bodies, prompts, strict=True):
            assert rebuilt == raw["prompt_token_ids"]  # the whole prompt, rebuilt from delta records
            assert record.generation_token_ids == raw["choices"][0]["token_ids"]
            assert record.generation_log_probs == [e["logprob"] for e in raw["choices"][0]["logprobs"]["content"]]
        assert [r.parent_call_id for r in sample.records] == [None, "turn-0", "turn-1"]
        assert sample.segments == memory.segments and sample.trajectory.drifts == memory.drifts
        assert Trajectory.from_snapshot(sample.snapshot, policy="split").segments == memory.segments
    assert sample.dropped


async def test_generate_records_each_turns_weight_versions_as_served(scale_out_url: str, tmp_path: Path) -> None:
    root = scale_out_url.removesuffix("/v1")
    recording = Recording()
    async with (
        open_store(f"sqlite:///{tmp_path}/r.db") as store,
        httpx.AsyncClient() as control,
        TokenClient(scale_out_url, http_client=httpx.AsyncClient(transport=recording), sink=store) as client,
    ):
        prompt = [1, 2, 3, 4, 5]
        served = []
        for turn, version in enumerate(["policy-1", "policy-2", "policy-3"]):
            update = await control.post(root + "/update_weight_version", json={"new_version": version})
            assert update.status_code == 200, update.text
            completion = await client.generate(
                prompt,
                sampling_params={"max_tokens": 6, "temperature": 1.0},
                rollout_id="gen-rollout",
                model_call_id=f"g{turn}",
            )
            served.append(recording.bodies[-1]["choices"][0]["weight_versions"])
            assert completion.bundle.weight_versions == tuple(WeightVersionSpan(**s) for s in served[-1])
            prompt = [*prompt, *completion.bundle.generation_token_ids, 7, 8]
        async with read_rollout(store, "gen-rollout") as sample:
            assert [[s.version for s in weight_spans(r)] for r in sample.records] == [
                ["policy-1"],
                ["policy-2"],
                ["policy-3"],
            ]
            for record, spans in zip(sample.records, served, strict=True):
                assert weight_spans(record) == tuple(WeightVersionSpan(**s) for s in spans)
            assert [r.parent_call_id for r in sample.records] == [None, "g0", "g1"]
            assert sample.trainable and len(sample.segments) == 1 and sample.segments[0].token_ids == prompt[:-2]
