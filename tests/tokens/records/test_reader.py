"""The trainer's side: chain order, delta rebuilds checked by digest, masks, conditional drops; the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokens.records.helpers import make_record
from tokens import Trajectory
from tokens.records import MalformedRecordError, TokenRecord, open_store, order_records, read_rollout
from tokens.records._cli import main

pytestmark = pytest.mark.anyio


def chain() -> list[TokenRecord]:
    first = make_record("r", "a", [1, 2], [3, 4])
    second = make_record("r", "b", [1, 2, 3, 4, 5], [6, -0 + 7], parent=("a", [1, 2, 3, 4]))
    third = make_record("r", "c", [1, 2, 3, 4, 5, 6, 7, 8], [9], parent=("b", [1, 2, 3, 4, 5, 6, 7]))
    return [third, first, second]  # order carries no meaning in a snapshot


def test_order_rebuilds_delta_prompts_in_chain_order() -> None:
    ordered = order_records(chain())
    assert [r.model_call_id for r, _ in ordered] == ["a", "b", "c"]
    assert [b.prompt_token_ids for _, b in ordered] == [[1, 2], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8]]
    (segment,) = Trajectory.from_snapshot(chain()).segments
    assert segment.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9] and segment.loss_mask == [0, 0, 1, 1, 0, 1, 1, 0, 1]


def test_a_broken_chain_is_refused_not_guessed() -> None:
    _, first, second = chain()
    with pytest.raises(MalformedRecordError, match="parent 'b' is not in the snapshot"):
        order_records([chain()[0], first])
    tampered = make_record("r", "b", [1, 2, 3, 4, 5], [6, 7], parent=("a", [1, 2, 3, 4]), digest="0" * 64)
    with pytest.raises(MalformedRecordError, match="do not have its digest"):
        order_records([first, tampered])
    with pytest.raises(MalformedRecordError, match="two records with one model_call_id"):
        order_records([first, first])
    assert len(order_records([second, first])) == 2


async def test_read_rollout_drops_only_what_it_consumed(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        for record in chain():
            await store.put(record)
        async with read_rollout(store, "r") as sample:
            assert sample.trainable and len(sample.segments) == 1 and sample.segments[0].turns == 3
            await store.mark_incomplete("r", "late")  # the state moves on after the snapshot
        assert not sample.dropped
        async with read_rollout(store, "r") as again:
            assert not again.trainable and again.notes[0].startswith("incomplete")
        assert again.dropped
        with pytest.raises(RuntimeError, match="a trainer crash"):
            async with read_rollout(store, "other"):
                raise RuntimeError("a trainer crash")
        assert not (await store.rollouts())[0].retired  # 'other': kept for the next reader


def test_cli_lists_shows_freezes_and_drops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import anyio

    url = f"sqlite:///{tmp_path}/r.db"

    async def fill() -> None:
        async with open_store(url) as store:
            for record in chain():
                await store.put(record)

    anyio.run(fill)
    assert main([url, "rollouts"]) == 0
    assert capsys.readouterr().out == "r\t3 records\tversion 3\topen\n"
    assert main([url, "show", "nosuch"]) == 1
    assert "no records of rollout 'nosuch'" in capsys.readouterr().err
    assert main([url, "show", "r"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("b\tparent a (resolved)\tprompt 5 (delta)\tgeneration 2")
    assert main([url, "freeze", "r"]) == 0
    out = capsys.readouterr().out
    assert "3 records, 1 segments, trainable" in out
    snapshot_id = out.split()[1]
    assert main([url, "drop", "r", "--snapshot-id", "wrong", "--version", "3"]) == 1
    assert main([url, "drop", "r", "--snapshot-id", snapshot_id, "--version", "3"]) == 0
    assert main([url, "freeze", "r"]) == 2 and "was dropped" in capsys.readouterr().err
    assert main(["ftp://x", "rollouts"]) == 2
