"""The capture proxy's conversation state in a record store (``token_responses``), on SQLite and
PostgreSQL alike: turns chained back to their first, shared by every client, gone after their time;
and a store made before the table existed gets it (the schema migration) with its records intact."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tokens.records.helpers import make_record
from tokens.records import open_store, record_payload
from tokens.records._schema import LATEST

pytestmark = pytest.mark.anyio


async def test_turns_chain_back_to_the_first_and_every_client_sees_them(store_url: str) -> None:
    async with open_store(store_url) as one, open_store(store_url) as two:
        await one.keep_response("resp_a", b'["a"]', None, "call-a", b"{}", ttl_s=60)
        await two.keep_response("resp_b", b'["b"]', "resp_a", "call-b", b"{}", ttl_s=60)
        await one.keep_response("resp_c", b'["c"]', "resp_b", "call-c", b"{}", ttl_s=60)
        await two.keep_response("resp_c", b'["other"]', "resp_b", "call-x", b"{}", ttl_s=60)  # a second keep: no change
        chain = await two.response_chain("resp_c", max_turns=100, max_bytes=2**20)
        assert chain == [
            ("resp_c", "resp_b", b'["c"]', "call-c"),
            ("resp_b", "resp_a", b'["b"]', "call-b"),
            ("resp_a", None, b'["a"]', "call-a"),
        ]
        assert await one.response_chain("resp_b", max_turns=1, max_bytes=2**20) == [
            ("resp_b", "resp_a", b'["b"]', "call-b")
        ]
        assert await one.response_chain("resp_unknown", max_turns=100, max_bytes=2**20) == []
        assert [turn[0] for turn in await one.response_chain("resp_c", max_turns=100, max_bytes=10)] == [
            "resp_c",
            "resp_b",
        ]  # 5 bytes each: a third would be over 10 together


async def test_a_turn_past_its_time_is_gone_and_deleted(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.keep_response("resp_old", b"[]", None, "call-old", b"{}", ttl_s=0.0)
        await store.keep_response("resp_new", b"[]", "resp_old", "call-new", b"{}", ttl_s=60)
        assert await store.response_chain("resp_old", max_turns=10, max_bytes=2**20) == []
        # the chain stops at the turn that is gone: its last turn still names it
        assert await store.response_chain("resp_new", max_turns=10, max_bytes=2**20) == [
            ("resp_new", "resp_old", b"[]", "call-new")
        ]
        count = await store._run(lambda cursor: cursor.execute("SELECT COUNT(*) FROM token_responses"), "count")
        assert count[0][0] == 1  # the expired turn was deleted when the next one was kept


async def test_a_store_made_before_the_table_gets_it_and_keeps_its_records(store_url: str) -> None:
    record = make_record("r1", "c1", [1, 2], [3, 4])
    async with open_store(store_url) as older:  # a store as an older client left it: records, no newest table
        await older.put(record)
        await older._run(lambda cursor: cursor.execute(f"DROP TABLE {LATEST}"), "drop")
    async with open_store(store_url) as store:  # a newer client migrates it on connect
        await store.keep_response("resp_a", b"[]", None, "c1", b"{}", ttl_s=60)
        assert await store.response_chain("resp_a", max_turns=1, max_bytes=2**20) == [("resp_a", None, b"[]", "c1")]
        assert [record_payload(entry) for entry in (await store.freeze("r1")).entries] == [record_payload(record)]


async def test_the_store_keeps_at_most_its_bounds_of_turns_for_every_client_together(store_url: str) -> None:
    """The oldest turns go first once the store holds more than ``max_turns`` turns or ``max_bytes``
    bytes together (every client's); a chain through an evicted turn ends there, and the counts the
    bound is checked against stay the table's own through expiry and eviction."""

    async def kept(store: Any) -> list[str]:
        rows = await store._run(lambda c: c.execute("SELECT response_id FROM token_responses"), "ids")
        return sorted(row[0] for row in rows)

    async def usage(store: Any) -> tuple[int, int]:
        ((turns, size),) = await store._run(
            lambda c: c.execute("SELECT turns, bytes FROM token_responses_usage WHERE id = 1"), "usage"
        )
        counted = await store._run(
            lambda c: c.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(items) + LENGTH(answer)), 0) FROM token_responses"
            ),
            "count",
        )
        assert (int(turns), int(size)) == (int(counted[0][0]), int(counted[0][1]))
        return int(turns), int(size)

    async with open_store(store_url) as one, open_store(store_url) as two:
        for turn in range(5):  # 10 bytes each (8 of items, 2 of answer), kept by two clients in turn
            client = (one, two)[turn % 2]
            previous = f"resp_{turn - 1}" if turn else None
            await client.keep_response(f"resp_{turn}", b'["item"]', previous, f"c{turn}", b"{}", ttl_s=60, max_turns=3)
        assert await kept(one) == ["resp_2", "resp_3", "resp_4"] and await usage(one) == (3, 30)
        assert [t[0] for t in await two.response_chain("resp_4", max_turns=10, max_bytes=2**20)] == [
            "resp_4",
            "resp_3",
            "resp_2",
        ]  # the chain ends where the evicted turn was: its earliest kept turn still names it
        await one.keep_response("resp_big", b"x" * 25, "resp_4", "cb", b"{}", ttl_s=60, max_bytes=40)  # 27 bytes
        assert await kept(one) == ["resp_4", "resp_big"] and await usage(two) == (2, 37)
        await two.keep_response("resp_gone", b"[]", None, "cg", b"{}", ttl_s=0.0)
        await one.keep_response("resp_next", b"[]", None, "cn", b"{}", ttl_s=60)  # the expired one is deleted
        assert await kept(two) == ["resp_4", "resp_big", "resp_next"] and await usage(one) == (3, 41)
