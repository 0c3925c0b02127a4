"""Real agents, unmodified, through the capture proxy: Codex CLI (Responses, streamed) and Claude Code
(Messages, streamed), each with its default configuration except the provider's base URL and key,
complete a multi-turn tool-using task (the model asks for a shell command, the agent runs it, the model
answers with what it read), and every model call's record holds exactly the ids and log probabilities
the upstream produced. The agents come from scripts/install-agents.sh (AGENTS_BIN; REQUIRE_AGENTS=1 in CI)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import anyio
import pytest

from pytest_llm_sandbox_middleware import FakeVLLMTransport
from tests.tokens.proxy.agents import ShellTask, agent_command, base_environment, check_records, run
from tests.tokens.proxy.sdk_types import Recording
from tokens.proxy import ProxyServer, create_app
from tokens.records import open_store, read_rollout
from tokens.testing import FAKE_VLLM_URL

TASK = "Read note.txt and tell me what it says."


@contextmanager
def proxied(task: ShellTask, tmp_path: Path) -> Iterator[tuple[ProxyServer, str]]:
    """The proxy in front of ``task`` with a SQLite record store; yields the server and the store's URL.
    On leaving, everything it answered to a model call is validated strictly with the SDKs' own types."""
    url = f"sqlite:///{tmp_path / 'records.db'}"
    store = open_store(url)
    app = Recording(create_app(FAKE_VLLM_URL + "/v1", transport=FakeVLLMTransport(task), store=store))
    try:
        with ProxyServer(app) as server:
            yield server, url
    finally:
        anyio.run(store.close)
    assert app.check() > 0


def records_of(url: str, rollout: str) -> list[Any]:
    async def read() -> list[Any]:
        reader = open_store(url)  # the trainer's own client
        try:
            async with read_rollout(reader, rollout) as sample:
                assert not sample.snapshot.incomplete
                return list(sample.records)
        finally:
            await reader.close()

    return anyio.run(read)


def workspace(tmp_path: Path, secret: str) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "note.txt").write_text(secret + "\n")
    return home, work


def codex(command: str, base_url: str, home: Path) -> tuple[list[str], dict[str, str]]:
    """Codex CLI with a model provider of its own config (the proxy), everything else its default."""
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "tiny"\n'
        'model_provider = "capture"\n'
        "[model_providers.capture]\n"
        'name = "capture proxy"\n'
        f'base_url = "{base_url}"\n'
        'env_key = "CAPTURE_API_KEY"\n'
        'wire_api = "responses"\n'
    )
    env = {**base_environment(home), "CODEX_HOME": str(codex_home), "CAPTURE_API_KEY": "agent-key"}
    return [command, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK], env


def claude(command: str, base_url: str, home: Path) -> tuple[list[str], dict[str, str]]:
    """Claude Code with the proxy as its Anthropic base URL, everything else its default."""
    env = {
        **base_environment(home),
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": "agent-key",
        "IS_SANDBOX": "1",  # root may skip permissions inside a sandbox
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry or update checks to the internet
    }
    return [command, "-p", "--model", "tiny", "--dangerously-skip-permissions", TASK], env


AGENTS = {"codex": ("exec_command", codex), "claude": ("Bash", claude)}
"""Each agent's command, the name of its own shell tool, and how it is pointed at the proxy."""


@pytest.mark.parametrize("thought", ["", "The note will say."], ids=["plain", "reasoning"])
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_a_real_agent_completes_a_shell_task_with_every_call_captured(tmp_path: Path, agent: str, thought: str) -> None:
    """With a reasoning model, the reasoning the agent was given (a Responses reasoning item, a thinking
    block) comes back to the upstream on the next turn as the assistant message's reasoning_content."""
    command = agent_command(agent)
    tool, setup = AGENTS[agent]
    secret = secrets.token_hex(4)
    task = ShellTask(tool=tool, secret=secret, thought=thought)
    home, work = workspace(tmp_path, secret)
    with proxied(task, tmp_path) as (server, url):
        argv, env = setup(command, server.base_url(f"rollout-{agent}"), home)
        done = run(argv, env, work)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"The note says {secret}." in done.stdout, done.stdout[-4000:]
    assert len(task.produced) >= 2 and task.produced[0].request.get("stream") is True  # streamed, as by default
    records = records_of(url, f"rollout-{agent}")
    check_records(records, task.produced)
    if agent == "codex":  # its default hosted tool, left out and named in every record
        assert all({"where": ANY, "type": "web_search", "reason": ANY} in (r.dropped or ()) for r in records)
    if thought:
        turn = task.produced[1].request["messages"]
        assert [m.get("reasoning_content") for m in turn if m["role"] == "assistant"] == [thought]
