"""A multi-turn tool-calling rollout through each dialect writes records whose lineage resolves:
every turn finds its parent (the proxy's store and the trainer's are separate clients of one file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import anyio
import openai
import pytest

from pytest_llm_sandbox_middleware import CaptureProxy, running_capture_proxy
from tokens.records import open_store, read_rollout

TOOL = {"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def chat_rollout(proxy: CaptureProxy, rollout: str) -> None:
    client = openai.OpenAI(base_url=proxy.base_url(rollout), api_key="-", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Time in Oslo?"}]
    proxy.fake.reply_tool_call(TOOL["name"], TOOL["arguments"])
    proxy.fake.reply("It is ten.", "You are welcome.")
    for turn, follow_up in enumerate(["Thanks!", None]):
        completion = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[CHAT_TOOL],
            max_tokens=200,
            extra_headers={"X-Model-Call-Id": f"turn-{turn}"},
            stream=turn == 1,
        )  # type: ignore[call-overload]
        if turn == 0:
            message = completion.choices[0].message
            messages += [
                message.model_dump(include={"role", "content", "tool_calls"}),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "10:00"},
            ]
        else:
            text = "".join(c.choices[0].delta.content or "" for c in completion if c.choices)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]
    client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, extra_headers={"X-Model-Call-Id": "turn-2"}
    )  # type: ignore[arg-type]


def responses_rollout(proxy: CaptureProxy, rollout: str) -> None:
    client = openai.OpenAI(base_url=proxy.base_url(rollout), api_key="-", max_retries=0)
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    items: list[Any] = [{"role": "user", "content": "Time in Oslo?"}]
    proxy.fake.reply_tool_call(TOOL["name"], TOOL["arguments"])
    proxy.fake.reply("It is ten.", "You are welcome.")
    first = client.responses.create(
        model="tiny", input=items, tools=[tool], max_output_tokens=200, extra_headers={"X-Model-Call-Id": "turn-0"}
    )  # type: ignore[list-item]
    call = first.output[0]
    items += [item.model_dump() for item in first.output]  # echoed back, bundle fields and all
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "10:00"})  # type: ignore[union-attr]
    events = client.responses.create(
        model="tiny",
        input=items,
        tools=[tool],
        max_output_tokens=200,
        stream=True,
        extra_headers={"X-Model-Call-Id": "turn-1"},
    )  # type: ignore[list-item]
    second = next(event for event in events if event.type == "response.completed").response
    client.responses.create(
        model="tiny",
        input="Thanks!",
        previous_response_id=second.id,
        max_output_tokens=200,
        extra_headers={"X-Model-Call-Id": "turn-2"},
    )


def messages_rollout(proxy: CaptureProxy, rollout: str) -> None:
    client = anthropic.Anthropic(base_url=proxy.base_url(rollout).removesuffix("/v1"), api_key="-", max_retries=0)
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    messages: list[Any] = [{"role": "user", "content": "Time in Oslo?"}]
    proxy.fake.reply_tool_call(TOOL["name"], TOOL["arguments"])
    proxy.fake.reply("It is ten.", "You are welcome.")
    first = client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=messages,
        tools=tools,  # type: ignore[arg-type]
        extra_headers={"X-Model-Call-Id": "turn-0"},
    )
    use = first.content[0]
    messages += [
        {
            "role": "assistant",
            "content": [block.model_dump(include={"type", "id", "name", "input"}) for block in first.content],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,  # type: ignore[union-attr]
                    "content": "10:00",
                }
            ],
        },
    ]
    with client.messages.stream(
        model="tiny",
        max_tokens=200,
        messages=messages,
        tools=tools,  # type: ignore[arg-type]
        extra_headers={"X-Model-Call-Id": "turn-1"},
    ) as stream:
        text = stream.get_final_message().content[0].text  # type: ignore[union-attr]
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks!"}]
    client.messages.create(
        model="tiny",
        max_tokens=200,
        messages=messages,
        tools=tools,  # type: ignore[arg-type]
        extra_headers={"X-Model-Call-Id": "turn-2"},
    )


@pytest.mark.parametrize("rollout", [chat_rollout, responses_rollout, messages_rollout], ids=lambda f: f.__name__)
def test_a_tool_calling_rollout_resolves_its_lineage(rollout: Any, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    store = open_store(url)
    with running_capture_proxy(store=store) as proxy:
        rollout(proxy, "rollout-1")
    calls = [body for path, body in proxy.fake.requests if path == "/v1/chat/completions"]
    assert len(calls) == 3 and not any("rollout" in json.dumps(body) for body in calls)

    async def read() -> Any:
        reader = open_store(url)  # the trainer's own client
        try:
            async with read_rollout(reader, "rollout-1") as sample:
                return sample
        finally:
            await reader.close()
            await store.close()

    sample = anyio.run(read)
    records = sample.records
    assert [r.model_call_id for r in records] == ["turn-0", "turn-1", "turn-2"]
    assert [r.parent_call_id for r in records] == [None, "turn-0", "turn-1"]
    assert [r.parent_resolution for r in records] == ["root", "resolved", "resolved"]
    assert not sample.snapshot.incomplete
    for record in records:
        assert len(record.generation_token_ids) == len(record.generation_log_probs) > 0


def test_a_store_that_fails_before_the_call_is_a_503_naming_no_store(tmp_path: Path) -> None:
    """begin_call failing for the store's own reasons (here: its file is not a database) is no
    frozen rollout (409 "takes no more calls"): a 503 to retry, nothing sent upstream, and the
    store's path stays out of the answer."""
    (tmp_path / "records.db").write_bytes(b"not a database, " * 512)
    store = open_store(f"sqlite:///{tmp_path / 'records.db'}")
    with running_capture_proxy(store=store) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url("r1"), api_key="-", max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert failed.value.status_code == 503 and "the record store failed" in failed.value.message
        assert str(tmp_path) not in failed.value.message and proxy.fake.requests == []
    anyio.run(store.close)
