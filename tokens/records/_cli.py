"""``tokens-records`` (or ``python -m tokens.records``): inspect a record store from a shell.

tokens-records URL rollouts              one line per rollout: records, version, state
tokens-records URL show ROLLOUT [--json] its records in chain order (no freeze)
tokens-records URL freeze ROLLOUT        freeze it; the snapshot id, version, trainable or why not
tokens-records URL drop ROLLOUT --snapshot-id ID --version N   retire it if unchanged since
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio
import msgspec

from ._errors import RecordsError
from ._open import open_store
from ._order import order_records
from ._reader import resolution_of, sample_of
from ._record import record_payload, weight_spans
from ._store import RecordStore

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokens-records", description="Inspect a tokens.records store.")
    parser.add_argument("url", help="sqlite:///FILE or postgresql://...")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("rollouts", help="list the rollouts")
    show = verbs.add_parser("show", help="a rollout's records in chain order, without freezing it")
    show.add_argument("rollout")
    show.add_argument("--json", action="store_true", help="the whole records, one JSON object a line")
    verbs.add_parser("freeze", help="freeze a rollout and print its snapshot").add_argument("rollout")
    drop = verbs.add_parser("drop", help="retire a frozen rollout, only if unchanged since its snapshot")
    drop.add_argument("rollout")
    drop.add_argument("--snapshot-id", required=True)
    drop.add_argument("--version", type=int, required=True)
    return parser


async def _run(store: RecordStore, args: argparse.Namespace) -> int:
    if args.verb == "rollouts":
        for r in await store.rollouts():
            state = "retired" if r.retired else "frozen" if r.frozen else "open"
            print(
                f"{r.rollout_id}\t{r.records} records\tversion {r.version}\t{state}"
                + ("\tINCOMPLETE" if r.incomplete else "")
            )
        return 0
    if args.verb == "show":
        records = await store.records(args.rollout)
        if not records:
            print(f"tokens-records: no records of rollout {args.rollout!r} in this store", file=sys.stderr)
            return 1
        for record, bundle in order_records(records):
            if args.json:
                print(msgspec.json.encode(record_payload(record)).decode())
                continue
            spans = ",".join(f"{s.version}[{s.start}:{s.end})" for s in weight_spans(record)) or "-"
            status = resolution_of(record)
            print(
                f"{record.model_call_id}\tparent {record.parent_call_id or '-'} ({status}"
                f"{': ' + record.parent_resolution_reason if record.parent_resolution_reason else ''})\t"
                f"prompt {len(bundle.prompt_token_ids)}{' (delta)' if record.prompt_is_delta else ''}\t"
                f"generation {len(bundle.generation_token_ids)}\tweights {spans}"
            )
        return 0
    if args.verb == "freeze":
        snapshot = await store.freeze(args.rollout)
        sample = sample_of(snapshot)
        print(
            f"snapshot {snapshot.snapshot_id} version {snapshot.version}: {len(snapshot.entries)} records, "
            f"{len(sample.segments)} segments, {'trainable' if sample.trainable else 'NOT trainable'}"
        )
        for note in sample.notes:
            print(f"  {note}")
        return 0
    dropped = await store.drop(args.rollout, snapshot_id=args.snapshot_id, version=args.version)
    print("dropped" if dropped else "not dropped: the rollout changed since that snapshot (or is not frozen)")
    return 0 if dropped else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    async def run() -> int:
        async with open_store(args.url) as store:
            return await _run(store, args)

    try:
        return anyio.run(run)
    except (RecordsError, ValueError) as exc:
        print(f"tokens-records: {exc}", file=sys.stderr)
        return 2
