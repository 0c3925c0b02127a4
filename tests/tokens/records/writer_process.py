"""A record writer run as its own process by the crash and cross-process tests.

    python -m tests.tokens.records.writer_process URL ROLLOUT COUNT TOKENS

puts COUNT records of TOKENS prompt ids each into ROLLOUT, printing ``begin I`` before and
``put I`` after each put returned (flushed), then ``done``.
"""

from __future__ import annotations

import sys

import anyio

from tests.tokens.records.helpers import make_record
from tokens.records import open_store


async def main(url: str, rollout: str, count: int, tokens: int) -> None:
    async with open_store(url) as store:
        for index in range(count):
            prompt = [(index * 7 + i) % 50_000 for i in range(tokens)]
            print(f"begin {index}", flush=True)
            await store.put(make_record(rollout, f"call-{index}", prompt, [index % 50_000] * 16))
            print(f"put {index}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
