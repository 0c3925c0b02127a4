"""Rollout credentials: with a rollout key, a request that names a rollout carries the token the
trainer minted for it (in the path or ``X-Rollout-Token``), or it is refused in its dialect's shape
before anything is read, recorded or sent upstream."""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from pytest_llm_sandbox_middleware import running_capture_proxy
from tokens.proxy import mint_rollout_token
from tokens.records import open_store, read_rollout

KEY = "k" * 32
USER = [{"role": "user", "content": "hi"}]


def test_the_token_is_hmac_sha256_of_the_rollout_id_and_a_short_key_is_refused() -> None:
    expected = hmac.new(KEY.encode(), b"rollout-1", hashlib.sha256).hexdigest()
    assert mint_rollout_token(KEY, "rollout-1") == mint_rollout_token(KEY.encode(), "rollout-1") == expected
    assert mint_rollout_token(KEY, "rollout-2") != expected
    with pytest.raises(ValueError, match="at least 16 bytes"):
        mint_rollout_token("short", "rollout-1")


def test_a_rollout_is_written_only_with_its_own_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    store = open_store(url)
    with running_capture_proxy(store=store, rollout_key=KEY) as proxy:
        token = mint_rollout_token(KEY, "rollout-1")
        good = openai.OpenAI(base_url=f"{proxy.url}/r/rollout-1/t/{token}/v1", api_key="-", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=USER, max_tokens=4).choices[0].message.content
        header = openai.OpenAI(
            base_url=proxy.base_url("rollout-1"), api_key="-", max_retries=0, default_headers={"X-Rollout-Token": token}
        )
        assert header.responses.create(model="tiny", input="hi", max_output_tokens=4).output
        served = len(proxy.fake.requests)

        missing = openai.OpenAI(base_url=proxy.base_url("rollout-1"), api_key="-", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="requires the rollout's token"):
            missing.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
        other = mint_rollout_token(KEY, "rollout-2")  # rollout-2's token does not open rollout-1
        wrong = anthropic.Anthropic(base_url=f"{proxy.url}/r/rollout-1/t/{other}", api_key="-", max_retries=0)
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            wrong.messages.create(model="tiny", max_tokens=4, messages=USER)  # type: ignore[arg-type]
        assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
        forged = httpx.post(
            proxy.base_url("rollout-1") + "/chat/completions",
            json={"model": "tiny", "messages": USER},
            headers={"X-Rollout-Token": token[:-1] + "0", "X-Model-Call-Id": "forged"},
        )
        assert forged.status_code == 403 and forged.json()["error"]["type"] == "permission_denied"
        unnamed = openai.OpenAI(base_url=proxy.base_url(), api_key="-", max_retries=0)  # no rollout: no record
        assert unnamed.chat.completions.create(model="tiny", messages=USER, max_tokens=4).choices
        assert len(proxy.fake.requests) == served + 1  # the refused ones never reached the upstream

    async def read() -> Any:
        try:
            async with read_rollout(store, "rollout-1") as sample:
                return sample
        finally:
            await store.close()

    sample = anyio.run(read)
    assert len(sample.records) == 2 and not sample.snapshot.incomplete
    assert "forged" not in {record.model_call_id for record in sample.records}


def test_the_command_takes_its_key_from_the_environment() -> None:
    """TOKENS_PROXY_ROLLOUT_KEY set: the proxy requires tokens; --rollout-key-env naming an unset
    variable is one line and exit 2."""
    env = {**os.environ, "TOKENS_PROXY_ROLLOUT_KEY": KEY}
    command = [sys.executable, "-m", "tokens.proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        body = {"model": "m", "max_tokens": 1, "messages": USER}
        refused = httpx.post(url + "/r/r1/v1/messages", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        token = mint_rollout_token(KEY, "r1")
        passed = httpx.post(url + f"/r/r1/t/{token}/v1/messages", json=body)  # past the check: the upstream is down
        assert passed.status_code == 502
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=20)
    unset = subprocess.run([*command, "--rollout-key-env", "NO_SUCH_KEY_SET"], capture_output=True, text=True)
    assert (
        unset.returncode == 2
        and unset.stderr.strip() == "tokens.proxy: the environment variable NO_SUCH_KEY_SET is not set"
    )


def test_the_side_routes_of_a_rollout_need_its_token_too() -> None:
    """Probes, the model list, token counts and legacy completions under a rollout are refused without
    its token (401) or with another (403), in their path's dialect, and served with it."""
    with running_capture_proxy(rollout_key=KEY) as proxy:
        token, other = mint_rollout_token(KEY, "rollout-1"), mint_rollout_token(KEY, "rollout-2")
        good, bad = f"{proxy.url}/r/rollout-1/t/{token}", f"{proxy.url}/r/rollout-1/t/{other}"
        assert httpx.head(good + "/v1").status_code == httpx.head(good).status_code == 200
        assert httpx.head(bad + "/v1").status_code == 403 and httpx.head(proxy.base_url("rollout-1")).status_code == 401
        assert httpx.get(good + "/v1/models").json()["data"][0]["id"] == "tiny"
        refused = httpx.get(proxy.base_url("rollout-1") + "/models")
        assert refused.status_code == 401 and "requires the rollout's token" in refused.json()["error"]["message"]
        count = httpx.post(bad + "/v1/messages/count_tokens", json={"model": "tiny", "messages": USER})
        assert count.status_code == 403 and count.json()["type"] == "error"  # Anthropic's shape under /messages
        served = len(proxy.fake.requests)
        completion = httpx.post(proxy.base_url("rollout-1") + "/completions", json={"model": "tiny", "prompt": "hi"})
        assert completion.status_code == 401 and len(proxy.fake.requests) == served  # nothing went upstream
        assert httpx.get(proxy.url + "/v1/models").status_code == 200  # naming no rollout: served, as without a key
