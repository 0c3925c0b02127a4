"""The capture proxy's conversation state in a record store (``token_responses``), on SQLite and
PostgreSQL alike: turns chained back to their first, shared by every client, gone after their time;
and a store made before the table existed gets it (the schema migration) with its records intact."""

from __future__ import annotations

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
