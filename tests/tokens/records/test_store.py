"""The record stores' semantics on SQLite and PostgreSQL alike, on asyncio and trio: what NeMo Gym's
conformance suite checks (tests/interop runs the suite itself), and the typed errors and lineage
answers of our own API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.tokens.records.helpers import USER, answer, make_record
from tokens.records import (
    ParentResolutionStatus,
    RecordConflictError,
    RecordStoreError,
    RolloutFrozenError,
    RolloutRetiredError,
    open_store,
    record_payload,
)
from tokens.records._cache import TokenCache

pytestmark = pytest.mark.anyio


async def test_put_then_a_fresh_client_freezes_it(store_url: str) -> None:
    record = make_record("r1", "c1", [1, 2], [3, 4])
    async with open_store(store_url) as writer:
        await writer.put(record)
    async with open_store(store_url) as reader:
        snapshot = await reader.freeze("r1")
        again = await reader.freeze("r1")
    assert [record_payload(entry) for entry in snapshot.entries] == [record_payload(record)]
    assert not snapshot.incomplete and snapshot.snapshot_id
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)


async def test_identical_reput_is_a_no_op_and_a_conflict_is_refused(store_url: str) -> None:
    async with open_store(store_url) as store:
        record = make_record("r1", "c1", [1, 2], [3, 4])
        await store.put(record)
        await store.put(make_record("r1", "c1", [1, 2], [3, 4]))
        before = await store.rollouts()
        with pytest.raises(RecordConflictError, match="'c1': already stored with another payload"):
            await store.put(make_record("r1", "c1", [1, 2], [5]))
        snapshot = await store.freeze("r1")
    assert before[0].records == 1 and not before[0].incomplete
    assert len(snapshot.entries) == 1 and snapshot.incomplete


async def test_a_frozen_rollout_refuses_puts_and_calls_but_takes_marks(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.put(make_record("r1", "c1", [1, 2], [3, 4]))
        snapshot = await store.freeze("r1")
        with pytest.raises(RolloutFrozenError, match="frozen"):
            await store.put(make_record("r1", "c2", [1, 2, 3, 4], [5]))
        with pytest.raises(RolloutFrozenError, match="nothing was sent"):
            await store.begin_call("r1", "c3")
        await store.put(make_record("r1", "c1", [1, 2], [3, 4]))  # an identical retry is still fine
        await store.mark_incomplete("r1", "c2")
        after = await store.freeze("r1")
        assert after.incomplete and after.version != snapshot.version
        assert not await store.drop("r1", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert await store.drop("r1", snapshot_id=after.snapshot_id, version=after.version)
        with pytest.raises(RolloutRetiredError, match="dropped"):
            await store.freeze("r1")
        with pytest.raises(RolloutRetiredError, match="new"):
            await store.put(make_record("r1", "c9", [1], [2]))


async def test_a_begun_call_without_its_record_masks_the_rollout(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.begin_call("r1", "c1")
        await store.begin_call("r1", "c2")
        await store.put(make_record("r1", "c1", [1, 2], [3, 4]))
        assert (await store.freeze("r1")).incomplete
        await store.begin_call("r2", "c1")
        await store.put(make_record("r2", "c1", [1, 2], [3, 4]))
        assert not (await store.freeze("r2")).incomplete


async def test_resolve_finds_the_parent_and_refuses_rewritten_or_ambiguous_history(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.put(make_record("r1", "c1", [1, 2, 3], [4, 5], text="sunny"))
        faithful = [*USER, *answer("sunny"), {"role": "user", "content": "tomorrow?"}]
        resolution = await store.resolve("r1", faithful)
        assert resolution.status == ParentResolutionStatus.RESOLVED and resolution.match is not None
        assert resolution.match.model_call_id == "c1" and list(resolution.match.cumulative_token_ids) == [1, 2, 3, 4, 5]
        rewritten = [{"role": "user", "content": "REWRITTEN"}, *answer("sunny")]
        assert (await store.resolve("r1", rewritten)).status == ParentResolutionStatus.UNRESOLVED
        assert (await store.resolve("r1", USER)).status == ParentResolutionStatus.ROOT
        assert (await store.resolve("r2", faithful)).reason == "no_match"  # another rollout's record is not seen
        await store.put(make_record("r1", "c2", [1, 2, 3], [4, 6], text="sunny"))  # same text, other tokens
        ambiguous = await store.resolve("r1", faithful)
        assert (ambiguous.status, ambiguous.reason) == (ParentResolutionStatus.UNRESOLVED, "ambiguous")
        bad = await store.resolve("r1", ["not an object"])  # type: ignore[list-item]
        assert bad.status == ParentResolutionStatus.UNRESOLVED and bad.reason.startswith("malformed_request")


async def test_delta_chains_rebuild_and_token_prefixes_resolve(store_url: str) -> None:
    async with open_store(store_url) as store:
        assert (await store.resolve_prefix("r1", [1, 2])).status == ParentResolutionStatus.ROOT
        await store.put(make_record("r1", "c1", [1, 2], [3]))
        await store.put(make_record("r1", "c2", [1, 2, 3, 9], [10], parent=("c1", [1, 2, 3])))
        await store.put(make_record("r1", "c3", [1, 2, 3, 9, 10, 11], [12], parent=("c2", [1, 2, 3, 9, 10])))
        match = await store.match("r1", "c3")
        assert match is not None and list(match.cumulative_token_ids) == [1, 2, 3, 9, 10, 11, 12]
        assert (await store.records("r1"))[2].prompt_token_ids == [11]  # stored as a delta
        longest = await store.resolve_prefix("r1", [1, 2, 3, 9, 10, 11, 12, 13])
        assert longest.match is not None and longest.match.model_call_id == "c3"
        middle = await store.resolve_prefix("r1", [1, 2, 3, 9, 10, 99])
        assert middle.match is not None and middle.match.model_call_id == "c2"
        none = await store.resolve_prefix("r1", [7, 7])
        assert (none.status, none.reason) == (ParentResolutionStatus.UNRESOLVED, "no_recorded_prefix")
        assert await store.match("r1", "nope") is None


async def test_open_store_refuses_bad_urls_without_showing_passwords() -> None:
    with pytest.raises(RecordStoreError, match="unknown scheme 'mysql'"):
        open_store("mysql://u:secret@h/db")
    with pytest.raises(RecordStoreError, match="no :memory:"):
        open_store("sqlite:///:memory:")
    with pytest.raises(RecordStoreError, match="does not exist"):
        open_store("sqlite:////nonexistent-dir/x.db")
    with pytest.raises(RecordStoreError) as caught:
        open_store("redis://user:hunter2@host/0")
    assert "hunter2" not in str(caught.value)
    for size in (0, "4", True):  # a string raised TypeError: '<=' not supported
        with pytest.raises(ValueError, match="pool_size must be an int between 1 and 64"):
            open_store("sqlite:///x.db", pool_size=size)  # type: ignore[arg-type]


async def test_a_closed_client_says_so_and_a_recreated_file_gets_its_tables(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/r.db"
    store = open_store(url)
    await store.put(make_record("r", "c", [1], [2]))
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RecordStoreError, match="closed; open a new one"):
        await store.freeze("r")
    (tmp_path / "r.db").unlink()
    async with open_store(url) as again:
        assert await again.rollouts() == []


async def test_a_store_that_fails_is_a_record_store_error_naming_it(tmp_path: Path) -> None:
    """The driver's own error (here sqlite3.DatabaseError: the file is not a database) reached the
    caller as it was; it is a RecordStoreError naming the store and the operation."""
    (tmp_path / "r.db").write_bytes(b"not a database, " * 512)
    async with open_store(f"sqlite:///{tmp_path}/r.db") as store:
        with pytest.raises(
            RecordStoreError, match=r"r\.db: put 'r'/'c' failed \(DatabaseError: file is not a database\)"
        ):
            await store.put(make_record("r", "c", [1], [2]))
        with pytest.raises(RecordStoreError, match="rollouts failed"):
            await store.rollouts()


async def test_a_long_chain_rebuilds_from_the_parents_already_resolved(sqlite_url: str) -> None:
    """Thirty turns, each a delta on the previous: each match reads only the new record once its
    parent was matched (the client's cache), and every rebuild still equals the whole sequence."""
    async with open_store(sqlite_url) as store:
        tokens: list[int] = [1, 2]
        parent: tuple[str, list[int]] | None = None
        for turn in range(30):
            generation = [100 + turn, 200 + turn]
            await store.put(make_record("r", f"t{turn}", tokens, generation, parent=parent))
            tokens = [*tokens, *generation]
            parent = (f"t{turn}", list(tokens))
            match = await store.match("r", f"t{turn}")
            assert match is not None and list(match.cumulative_token_ids) == tokens
            tokens = [*tokens, 7]
        executed: list[str] = []
        chain = store._chain

        def counting(cursor: Any, rollout: str, call: str) -> Any:
            original = cursor.execute

            class Counting:
                def execute(self, sql: str, params: Any = ()) -> Any:
                    executed.append(sql)
                    return original(sql, params)

            return chain(Counting(), rollout, call)

        store._chain = counting  # type: ignore[method-assign]
        fresh = await store.match("r", "t29")
        assert fresh is not None and len(executed) == 1  # t28 was cached by the turn before
        async with open_store(sqlite_url) as other:  # a fresh client rebuilds the whole chain, equally
            again = await other.match("r", "t29")
        assert again is not None and again.cumulative_token_ids == fresh.cumulative_token_ids


def test_the_token_cache_keeps_to_its_budget() -> None:
    cache = TokenCache(10)
    cache.put(("r", "a"), (1,) * 6)
    cache.put(("r", "b"), (2,) * 4)
    assert cache.get(("r", "a")) is not None  # a is now the most recently used
    cache.put(("r", "c"), (3,) * 3)
    assert cache.get(("r", "b")) is None and cache.get(("r", "a")) and cache.get(("r", "c"))
    cache.put(("r", "huge"), (4,) * 11)
    assert cache.get(("r", "huge")) is None


async def test_a_client_that_waited_for_another_s_schema_runs_no_ddl(postgres_url: str) -> None:
    """Many workers connecting to a new PostgreSQL store at once all find its tables missing; those
    that wait for the first one's schema lock find them made, and return without locking tables its
    writers already use. Running the DDL again, the waiter's index statement waited for an open write."""
    import psycopg

    from tokens.records._postgres import _SCHEMA_LOCK
    from tokens.records._schema import ddl

    with psycopg.connect(postgres_url, autocommit=True) as first, psycopg.connect(postgres_url) as writer:
        first.execute("SELECT pg_advisory_lock(%s)", (_SCHEMA_LOCK,))  # the first client, making the schema
        connected = anyio.Event()

        async def waiter() -> None:
            async with open_store(postgres_url) as store:
                assert await store.records("r") == ()
            connected.set()

        async with anyio.create_task_group() as group:
            group.start_soon(waiter)
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            with anyio.fail_after(10):
                while first.execute(waiting).fetchone() != (1,):  # the waiter found no tables, and waits
                    await anyio.sleep(0.02)
            for statement in ddl(blob="BYTEA", float_="DOUBLE PRECISION", int_="BIGINT"):
                first.execute(statement)
            writer.execute("INSERT INTO token_marks VALUES ('r', 't0', 'open', 0)")  # a write in progress
            writer.execute("LOCK TABLE token_records IN ROW EXCLUSIVE MODE")  # what its put holds, open
            first.execute("SELECT pg_advisory_unlock(%s)", (_SCHEMA_LOCK,))
            with anyio.move_on_after(10):
                await connected.wait()
            in_time = connected.is_set()
            writer.rollback()  # the old waiter, blocked behind it, goes on now
        assert in_time
