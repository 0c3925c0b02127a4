"""Crash safety with real SIGKILLs of a writer process: a record acknowledged by ``put`` survives;
a writer killed inside ``put`` leaves the whole record or nothing, and the store goes on working."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests import ROOT
from tests.tokens.records.helpers import make_record
from tokens.records import compute_digest, open_store, order_records

pytestmark = pytest.mark.anyio


def writer(url: str, rollout: str, count: int, tokens: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tokens.records.writer_process", url, rollout, str(count), str(tokens)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def kill_after(process: subprocess.Popen[str], line: str, delay: float = 0.0) -> list[str]:
    """Read the writer's lines until ``line``, then SIGKILL it (after ``delay``); the lines read."""
    assert process.stdout is not None
    seen: list[str] = []
    try:
        for raw in process.stdout:
            seen.append(raw.strip())
            if seen[-1] == line:
                if delay:
                    time.sleep(delay)
                process.send_signal(signal.SIGKILL)
                break
    finally:
        process.wait(timeout=60)
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL, f"the writer was not killed: {seen[-3:]}"
    return seen


async def test_a_writer_killed_right_after_put_loses_nothing(store_url: str) -> None:
    seen = kill_after(writer(store_url, "r", 50, 2000), "put 20")
    async with open_store(store_url) as store:
        stored = {r.model_call_id for r in await store.records("r")}
        assert {f"call-{i}" for i in range(21)} <= stored, seen[-3:]
        await store.put(make_record("r", "after", [1], [2]))  # the store works after the crash
        assert len(order_records((await store.freeze("r")).entries)) == len(stored) + 1


async def test_a_writer_killed_mid_put_leaves_no_torn_record(store_url: str) -> None:
    """Big records (200K prompt ids, ~1 MB each) killed at random moments inside ``put``: five kills,
    more (up to 20) until one has landed before its put's commit (on a loaded machine this process may
    read the writer's "begin" line late, and every kill of five may land after the commit)."""
    rng = random.Random(int(os.environ.get("CRASH_SEED", "7")))
    killed_inside = 0
    for attempt in range(20):
        if attempt >= 5 and killed_inside:
            break
        rollout, target = f"r{attempt}", rng.randrange(1, 5)
        kill_after(writer(store_url, rollout, 6, 200_000), f"begin {target}", rng.uniform(0.0, 0.03))
        async with open_store(store_url) as store:
            stored = await store.records(rollout)
            ids = sorted(int(r.model_call_id.split("-")[1]) for r in stored)
            assert ids == list(range(len(ids)))  # a prefix of the calls, each whole
            for record in stored:
                assert len(record.prompt_token_ids) == 200_000 and len(record.generation_token_ids) == 16
                assert compute_digest(record.prompt_token_ids + record.generation_token_ids) == record.digest
            killed_inside += f"call-{target}" not in {r.model_call_id for r in stored}
            await store.put(make_record(rollout, "after", [1], [2]))
    assert killed_inside, "no kill landed inside a put (before its commit): the test proved nothing"
