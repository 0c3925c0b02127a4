"""Agents built on the official SDKs and on litellm through the capture proxy: each a tool loop (the
model asks for a shell command, the agent runs it, the model answers with what it read), as their users
write them, echoing each answer back into the next request. Every record holds exactly the upstream's
ids. litellm keeps the bundle the proxy adds on each answer's message (``provider_specific_fields``) and
sends it back every turn; the proxy strips it, so the upstream gets what the agent meant."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.needs import unavailable
from tests.tokens.proxy.agents import ShellTask, check_records
from tests.tokens.proxy.test_agents import proxied, records_of, workspace
from tokens.proxy._chat import TOKEN_FIELDS

pytestmark = pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning")  # litellm's own

SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@pytest.fixture(scope="module")
def litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list from the internet
    try:
        import litellm
    except ImportError:
        unavailable("litellm is not installed: pip install -e '.[litellm]'", "REQUIRE_LITELLM")
    return litellm


def shell(command: str, work: Path) -> str:
    return subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True, timeout=30).stdout


def agent(litellm: Any, base_url: str, task: str, work: Path, *, stream: bool) -> str:
    """A minimal litellm tool loop: call the model, run each shell call it asks for, until it answers."""
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(4):
        options = {"model": "openai/tiny", "api_base": base_url, "api_key": "agent-key", "max_tokens": 300}
        answer = litellm.completion(messages=messages, tools=[SHELL], stream=stream, **options)
        if stream:
            answer = litellm.stream_chunk_builder(list(answer), messages=messages)
        message = answer.choices[0].message
        messages.append(message)  # as litellm's users do: its message, with what it kept of ours
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            output = shell(json.loads(call.function.arguments)["command"], work)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    raise AssertionError("the agent did not finish in 4 turns")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_litellm_agent_completes_and_sends_no_bundle_back(litellm: Any, tmp_path: Path, stream: bool) -> None:
    secret = secrets.token_hex(4)
    task = ShellTask(tool="shell", secret=secret)
    _, work = workspace(tmp_path, secret)
    with proxied(task, tmp_path) as (server, url):
        answer = agent(litellm, server.base_url("rollout-litellm"), "Read note.txt.", work, stream=stream)
        answer = agent(litellm, server.base_url("rollout-litellm"), "Read note.txt again.", work, stream=stream)
    assert answer == f"The note says {secret}."
    assert len(task.produced) == 4
    for produced in task.produced:
        sent = json.dumps(produced.request["messages"])
        assert not any(name in sent for name in (*TOKEN_FIELDS, "token_bundles")), sent[:2000]
    echoed = task.produced[1].request["messages"][1]  # litellm's own message, as it sent it back
    assert echoed["role"] == "assistant" and echoed.get("provider_specific_fields", {}).keys() <= {"reasoning"}
    check_records(records_of(url, "rollout-litellm"), task.produced)


def openai_chat_agent(client: openai.OpenAI, task: str, work: Path) -> str:
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(4):
        message = client.chat.completions.create(model="tiny", messages=messages, tools=[SHELL], max_tokens=300)  # type: ignore[list-item]
        message = message.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the answer echoed whole, bundle and all
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            output = shell(json.loads(call.function.arguments)["command"], work)  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    raise AssertionError("the agent did not finish in 4 turns")


def openai_responses_agent(client: openai.OpenAI, task: str, work: Path) -> str:
    tool = {"type": "function", "name": "shell", "parameters": SHELL["function"]["parameters"]}  # type: ignore[index]
    items: list[Any] = [{"role": "user", "content": task}]
    for _ in range(4):
        with client.responses.stream(model="tiny", input=items, tools=[tool], max_output_tokens=300) as stream:  # type: ignore[list-item]
            response = stream.get_final_response()
        items += response.output  # the output echoed as the next input, bundle fields and all
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:
            output = shell(json.loads(call.arguments)["command"], work)
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    raise AssertionError("the agent did not finish in 4 turns")


def anthropic_agent(client: anthropic.Anthropic, task: str, work: Path) -> str:
    tool = {"name": "shell", "input_schema": SHELL["function"]["parameters"]}  # type: ignore[index]
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(4):
        with client.messages.stream(model="tiny", max_tokens=300, messages=messages, tools=[tool]) as stream:  # type: ignore[list-item]
            message = stream.get_final_message()
        messages.append({"role": "assistant", "content": message.content})
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            return "".join(block.text for block in message.content if block.type == "text")
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": shell(use.input["command"], work)}  # type: ignore[index]
            for use in uses
        ]
        messages.append({"role": "user", "content": results})
    raise AssertionError("the agent did not finish in 4 turns")


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_an_sdk_agent_completes_with_every_call_captured(tmp_path: Path, dialect: str) -> None:
    secret = secrets.token_hex(4)
    task = ShellTask(tool="shell", secret=secret)
    _, work = workspace(tmp_path, secret)
    with proxied(task, tmp_path) as (server, url):
        base = server.base_url(f"rollout-{dialect}")
        if dialect == "messages":
            client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="agent-key", max_retries=0)
            answer = anthropic_agent(client, "Read note.txt.", work)
        else:
            runner = openai_chat_agent if dialect == "chat" else openai_responses_agent
            answer = runner(openai.OpenAI(base_url=base, api_key="agent-key", max_retries=0), "Read note.txt.", work)
    assert answer == f"The note says {secret}."
    assert len(task.produced) == 2
    for produced in task.produced:
        assert not any(name in json.dumps(produced.request) for name in (*TOKEN_FIELDS, "token_bundles"))
    check_records(records_of(url, f"rollout-{dialect}"), task.produced)
