"""Workers of the cross-process test: each captures its share of the turns of the same rollouts
through one store (a turn waits for the previous turn's record, written by another worker, and
rebuilds the conversation from it); the freezer freezes each rollout once every turn is in.

    python -m tests.tokens.records.rollout_worker capture URL ROLLOUTS TURNS INDEX WORKERS
    python -m tests.tokens.records.rollout_worker freeze URL ROLLOUTS TURNS   (prints JSON)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import httpx

from tokens import TokenClient, Trajectory
from tokens.records import RecordStore, open_store
from tokens.testing import FakeVLLM

WAIT_S = 120.0


async def _records_of(store: RecordStore, rollout: str, count: int) -> dict[str, Any]:
    """Wait until ``rollout`` has at least ``count`` records; them by model call id."""
    with anyio.fail_after(WAIT_S):
        while True:
            found = {record.model_call_id: record for record in await store.records(rollout)}
            if len(found) >= count:
                return found
            await anyio.sleep(0.02)


def conversation(rollout: str, turn: int, found: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of ``turn``: the user's turns and the recorded answers before it."""
    messages: list[dict[str, Any]] = []
    for earlier in range(turn):
        messages.append({"role": "user", "content": f"{rollout}: turn {earlier}"})
        messages.append({"role": "assistant", "content": found[f"t{earlier}"].output_items[0]["content"]})
    return [*messages, {"role": "user", "content": f"{rollout}: turn {turn}"}]


async def capture_turns(url: str, rollouts: list[str], turns: int, index: int, workers: int) -> int:
    """Capture turns ``index``, ``index + workers``, ... of every rollout; the number captured."""
    captured = 0
    fake = FakeVLLM()
    async with (
        open_store(url) as store,
        TokenClient(
            "http://vllm.test:8000/v1",
            http_client=httpx.AsyncClient(transport=httpx.MockTransport(fake)),
            request_prompt_and_generation_token_ids=True,
            sink=store,
            weight_version=f"worker-{index}",
        ) as client,
    ):
        for turn in range(index, turns, workers):
            for rollout in rollouts:
                found = await _records_of(store, rollout, turn)
                await client.chat_completion(
                    model="tiny",
                    messages=conversation(rollout, turn, found),
                    max_tokens=12,
                    rollout_id=rollout,
                    model_call_id=f"t{turn}",
                )
                captured += 1
    return captured


async def freeze_all(url: str, rollouts: list[str], turns: int) -> dict[str, Any]:
    """Freeze each rollout once it has every turn: what its snapshot holds."""
    report: dict[str, Any] = {}
    async with open_store(url) as store:
        for rollout in rollouts:
            await _records_of(store, rollout, turns)
            snapshot = await store.freeze(rollout)
            trajectory = Trajectory.from_snapshot(snapshot)
            report[rollout] = {
                "turns": sorted(entry.model_call_id for entry in snapshot.entries),
                "incomplete": snapshot.incomplete,
                "resolutions": sorted(
                    {
                        str(getattr(e.parent_resolution, "value", e.parent_resolution))
                        for e in snapshot.entries
                        if e.model_call_id != "t0"
                    }
                ),
                "parents": {e.model_call_id: e.parent_call_id for e in snapshot.entries},
                "deltas": sum(e.prompt_is_delta for e in snapshot.entries),
                "segments": len(trajectory.segments),
                "segment_turns": trajectory.segments[0].turns,
                "versions": sorted({v["version"] for e in snapshot.entries for v in e.weight_versions or []}),
            }
    return report


if __name__ == "__main__":
    verb, url, rollouts, turns = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    if verb == "capture":
        print(anyio.run(capture_turns, url, rollouts, turns, int(sys.argv[5]), int(sys.argv[6])))
    else:
        print(json.dumps(anyio.run(freeze_all, url, rollouts, turns)))
