"""NeMo Gym 0.7.0's own conformance suite for token-capture transports, run against our SQLite and
PostgreSQL stores (with its lineage factory and ``begin_call``): every check it has passes, none
skipped. Its golden digest vectors equal ours; its records and fingerprints are ours."""

from __future__ import annotations

import ast
import inspect
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import require_nemo_gym

require_nemo_gym()

from nemo_gym.token_id_capture import conformance, fingerprint  # noqa: E402
from nemo_gym.token_id_capture import records as nemo_records  # noqa: E402
from nemo_gym.token_id_capture.protocols import LineageResolver, TokenSink, TokenSource  # noqa: E402
from nemo_gym.token_id_capture.staging.conformance import load_golden_vectors  # noqa: E402
from nemo_gym.token_id_capture.store import TokenCaptureStore  # noqa: E402

from tests.postgres import fresh_database, running_postgres  # noqa: E402
from tests.tokens.records.helpers import make_record  # noqa: E402
from tokens import records  # noqa: E402

pytestmark = pytest.mark.anyio


def suite_checks() -> list[str]:
    """Every check name ``run_conformance`` can run, read from its source (so a check added in a
    later NeMo Gym release cannot go unnoticed)."""
    tree = ast.parse(inspect.getsource(conformance.run_conformance))
    return [
        node.elts[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant)
        and isinstance(node.elts[0].value, str) and len(node.elts) == 2
    ]  # fmt: skip


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "sqlite":
        with tempfile.TemporaryDirectory() as folder:
            yield f"sqlite:///{folder}/records.db"
        return
    with running_postgres() as cluster, fresh_database(cluster) as url:
        yield url


async def test_nemo_gym_conformance_suite_passes_every_check(store_url: str) -> None:
    def factory() -> Any:
        return records.open_store(store_url)

    passed = await conformance.run_conformance(factory, factory, factory)
    print(f"{store_url.split(':')[0]}: {passed}")
    assert passed == suite_checks()
    assert len(passed) == 10 and "begin_call_custody" in passed and "fresh_client_lineage_visibility" in passed
    store = factory()
    assert isinstance(store, TokenSink) and isinstance(store, TokenSource) and isinstance(store, LineageResolver)
    await store.close()


def test_golden_vectors_equal_ours() -> None:
    vectors = load_golden_vectors()
    assert records.compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert records.compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]
    for ids in ([], [0], [1, 2, 3], list(range(5000)), [2**64 - 1]):
        assert records.compute_digest(ids) == nemo_records.compute_digest(ids)


CONVERSATIONS: list[list[Any]] = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "x"}]},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function",
      "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2.5, "é"]}'}}]},
     {"role": "tool", "tool_call_id": "t1", "content": "42"}, {"role": "assistant", "content": "done"}],
    [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
     {"type": "reasoning", "summary": []}, {"type": "function_call", "call_id": "c", "name": "g", "namespace": "ns",
      "arguments": "not json "}, {"type": "function_call_output", "call_id": "c", "output": {"k": [1, None]}},
     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"},
                                                          {"type": "refusal", "refusal": "no"}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u",
                                   "content": [{"type": "text", "text": "r"}]}]},
     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                       {"type": "tool_use", "id": "u2", "name": "h", "input": {"z": 1, "y": True}}]}],
    [{"role": "user", "content": "no model turn"}],
]  # fmt: skip


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_fingerprints_equal_nemo_gyms(messages: list[Any]) -> None:
    assert records.assistant_fingerprint(messages) == fingerprint.assistant_fingerprint(messages)
    assert records.conversation_digest(messages) == fingerprint.conversation_digest(messages)
    assert records.FINGERPRINT_VERSION == fingerprint.FINGERPRINT_VERSION


async def test_our_records_are_nemo_gym_token_entries_both_ways(tmp_path: Path) -> None:
    """Ours validate as its TokenEntry with the same dump; a store read gives its class back; its
    own file store takes the records capture writes."""
    ours = make_record("r", "c1", [1, 2], [3], weight_versions=[{"version": "v1", "start": 0, "end": 1}])
    entry = nemo_records.TokenEntry.model_validate(records.record_payload(ours))
    assert entry.model_dump(mode="json") == records.record_payload(ours)
    assert records.encode_record(entry) == records.encode_record(ours)
    async with records.open_store(f"sqlite:///{tmp_path}/r.db") as store:
        await store.put(ours)
        (back,) = (await store.freeze("r")).entries
    assert isinstance(back, nemo_records.TokenEntry) and back.weight_versions == ours.weight_versions
    assert nemo_records.cumulative_tokens(back) == [1, 2, 3]
    newer = {**records.record_payload(ours), "schema_version": 2}
    with pytest.raises(records.RecordSchemaError, match="schema_version 2"):
        records.decode_record(records.encode_record(ours)[0].replace(b'"schema_version":1', b'"schema_version":2'))
    with pytest.raises(ValueError, match="schema_version 2"):
        nemo_records.TokenEntry.model_validate(newer)
    file_store = TokenCaptureStore(tmp_path / "nemo")
    writer = records.RecordWriter(file_store)
    await writer._put(ours)  # the writer hands NeMo Gym's own sinks its own class
    (stored,) = (await file_store.freeze("r")).entries
    assert stored.model_dump(mode="json") == records.record_payload(ours)
