"""Real agents through the capture proxy: where they are installed, how a test runs one, and the scripted
model behind the proxy that gives them a multi-turn tool-using task.

The agents (Codex CLI, Claude Code) are installed by ``scripts/install-agents.sh`` outside the checkout;
``AGENTS_BIN`` names the folder of their commands (``.ci/run`` sets it and ``REQUIRE_AGENTS=1``). Each run
gets its own HOME, config folder and working directory in a temp dir, removed after.

``ShellTask`` is the model: asked with the agent's own shell tool among its tools, it first calls that
tool to read a file holding a random word; once the tool's output is in the conversation, it answers
with the word it read. Every answer it gives is kept with the exact prompt ids, generation ids and log
probabilities it produced, for comparing with the records the proxy wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.needs import unavailable
from tokens.testing import FakeVLLM
from tokens.testing._fake_vllm import TOOL_CALL

INSTALL = "bash scripts/install-agents.sh (Node.js and npm: apt-get install -y nodejs npm)"
RUN_TIMEOUT_S = 180.0


def agent_command(name: str) -> str:
    """The installed agent's command (``codex``, ``claude``); skipped (failed with REQUIRE_AGENTS=1) without it."""
    folder = os.environ.get("AGENTS_BIN")
    found = shutil.which(name, path=folder) if folder else None
    if found is None:
        unavailable(f"{name} is not installed (AGENTS_BIN={folder or 'unset'}): {INSTALL}", "REQUIRE_AGENTS")
    return found


@dataclass(frozen=True)
class Produced:
    """One answer of the upstream: the path, the request body, and the exact ids it sampled."""

    path: str
    request: dict[str, Any]
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


def _produced(path: str, request: dict[str, Any], answer: httpx.Response) -> Produced | None:
    if answer.status_code != 200:
        return None
    if not answer.headers.get("content-type", "").startswith("text/event-stream"):
        body = answer.json()
        choice = body["choices"][0]
        return Produced(
            path,
            request,
            body["prompt_token_ids"],
            choice["token_ids"],
            [entry["logprob"] for entry in choice["logprobs"]["content"]],
        )
    prompt: list[int] = []
    ids: list[int] = []
    lps: list[float] = []
    for line in answer.content.splitlines():
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        prompt = chunk.get("prompt_token_ids") or prompt
        for choice in chunk.get("choices") or ():
            if choice["index"] == 0 and choice.get("token_ids"):
                ids += choice["token_ids"]
                lps += [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return Produced(path, request, prompt, ids, lps)


def shell_arguments(tool: Mapping[str, Any], command: str) -> dict[str, Any] | None:
    """Arguments that make a shell tool (by its JSON schema) run ``command``; None for another tool."""
    function = tool.get("function", tool)
    properties = (function.get("parameters") or {}).get("properties") or {}
    for name in ("command", "cmd"):
        kind = (properties.get(name) or {}).get("type")
        if kind == "string":
            return {name: command}
        if kind == "array":
            return {name: ["bash", "-lc", command]}
    return None


def _text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content)


@dataclass
class ShellTask(FakeVLLM):
    """The scripted model of the agents' task: call the shell tool named ``tool`` with ``command``; once
    ``secret`` is in a tool's output, answer ``The note says <secret>.``; other requests (an agent's own
    side calls) get the fake's default texts. ``produced`` keeps every answer's exact ids."""

    max_model_len: int = 2**20  # an agent's own instructions and tools are tens of thousands of tokens
    default_max_tokens: int = 4096  # agents name no limit: vLLM's is the rest of the context
    tool: str = "shell"
    command: str = "cat note.txt"
    secret: str = ""
    thought: str = ""
    """With a thought, the model reasons first (vLLM's reasoning parser): each answer starts with it."""
    produced: list[Produced] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reasoning_parser = bool(self.thought)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content or b"null") if request.method == "POST" else None
        if isinstance(body, dict) and path == "/v1/chat/completions":
            self._plan(body)
        answer = super().__call__(request)
        if isinstance(body, dict) and path == "/v1/chat/completions":
            produced = _produced(path, body, answer)
            if produced is not None:
                self.produced.append(produced)
        return answer

    def _plan(self, body: Mapping[str, Any]) -> None:
        messages = body.get("messages") or []
        outputs = " ".join(_text(m.get("content")) for m in messages if m.get("role") == "tool")
        tools = {t.get("function", {}).get("name"): t for t in body.get("tools") or ()}
        think = f"<think>{self.thought}</think>\n" if self.thought else ""
        if self.secret and self.secret in outputs:
            self.reply(f"{think}The note says {self.secret}.")
        elif self.tool in tools and not any(m.get("role") == "tool" for m in messages):
            arguments = shell_arguments(tools[self.tool], self.command)
            assert arguments is not None, f"{self.tool} takes no command: {tools[self.tool]}"
            self.reply(think + TOOL_CALL.format(json.dumps({"name": self.tool, "arguments": arguments})))


@dataclass
class AgentRun:
    """An agent's finished run: exit code, output, and the dirs it ran in (removed by the caller's tmp_path)."""

    returncode: int
    stdout: str
    stderr: str


def run(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> AgentRun:
    """Run an agent to its end (killed after ``RUN_TIMEOUT_S``), stdin closed."""
    try:
        done = subprocess.run(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{argv[0]} did not finish in {RUN_TIMEOUT_S:g} s; its output: {exc.stdout!r} {exc.stderr!r}"
        ) from None
    return AgentRun(done.returncode, done.stdout, done.stderr)


def base_environment(home: Path) -> dict[str, str]:
    """A clean environment for an agent: its own HOME (and caches), PATH, no proxy settings of ours."""
    keep = ("PATH", "LANG", "TERM", "SYSTEMROOT")
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    env.update(XDG_DATA_HOME=str(home / ".local/share"), XDG_STATE_HOME=str(home / ".local/state"), TMPDIR=str(home))
    return env


def full_prompts(records: Sequence[Any]) -> list[list[int]]:
    """Each record's whole prompt (a delta prompt rebuilt from its parent's tokens)."""
    whole: dict[str, list[int]] = {}
    prompts = []
    for record in records:
        prompt = list(record.prompt_token_ids)
        if record.prompt_is_delta:
            parent = whole[record.parent_call_id]
            prompt = parent + prompt
        whole[record.model_call_id] = prompt + list(record.generation_token_ids)
        prompts.append(prompt)
    return prompts


def check_records(records: Sequence[Any], produced: Sequence[Produced]) -> None:
    """One record per model call, each with exactly the ids and log probabilities the upstream produced."""
    assert len(records) == len(produced), (len(records), [p.path for p in produced])
    for record, prompt, made in zip(records, full_prompts(records), produced, strict=True):
        assert prompt == made.prompt_token_ids
        assert list(record.generation_token_ids) == made.generation_token_ids
        assert list(record.generation_log_probs) == made.generation_log_probs
