"""A litellm-based agent through the capture proxy: a tool loop (the model asks for a shell command, the
agent runs it, the model answers), whole and streamed. litellm keeps the bundle the proxy adds on each
answer's message (``provider_specific_fields``) and sends it back every turn; the proxy strips it, so the
upstream gets what the agent meant, and the records hold exactly the upstream's ids."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

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
            command = json.loads(call.function.arguments)["command"]
            done = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True, timeout=30)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": done.stdout})
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
