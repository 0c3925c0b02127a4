"""`sandbox-middleware run` finds and reaps its lost-create orphans; `sandbox-middleware reap` closes what
crashed workers left, by id, and nothing of a live run."""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import partial
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import (
    LocalProvider,
    Middleware,
    OwnershipMiddleware,
    SandboxHandle,
    SandboxSpec,
    register_provider,
    stack,
)
from sandbox_middleware._registry import provider_registry
from sandbox_middleware.cli._main import main
from sandbox_middleware.testing import FaultInjectingProvider
from tests.providers import crashed_worker, dead_owner_stamp, in_own_pid_namespace, live_worker
from tests.sandbox.test_reaper import _WORKER
from tests.vllm.server import free_port

from .test_cli import retries, row, run


def _config(tmp_path: Path, base: Path) -> Path:
    config = tmp_path / "stack.yaml"
    config.write_text(f"""\
provider: {{local: {{isolation: none, base_dir: "{base}"}}}}
middleware:
  - metrics
  - release_accounting
  - retry: {{attempts: 5, wait_initial: 0.01, wait_max: 0.02, wait_jitter: 0.01, operations: [create],
             on: [SandboxCreateError]}}
  - ownership
""")
    return config


def test_lost_create_responses_are_reported_as_orphans_and_reaped(tmp_path: Path, sandbox_base: Path) -> None:
    """`--faults lost_create=`: each lost response leaves a sandbox no ledger holds; the run lists and closes it."""
    done = run(
        "run",
        str(_config(tmp_path, sandbox_base)),
        "--sessions",
        "30",
        "--concurrency",
        "4",
        "--commands",
        "1",
        "--faults",
        "lost_create=0.2",
        "--seed",
        "3",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert row(done.stdout, "sessions ok / failed") == "30 / 0"
    found, rest = row(done.stdout, "orphans found / reaped").split(" / ", 1)
    reaped, _, ids = rest.partition(": ")
    # Only lost responses are injected, and each one made the retry layer create again.
    assert int(found) == int(reaped) == retries(done.stdout)["create"] > 0
    assert len(ids.split(", ")) == int(found) and "NOT closed" not in ids
    assert row(done.stdout, "sandboxes still held") == "0"
    assert not list(sandbox_base.iterdir())  # ground truth: nothing of the run is left on the provider
    assert re.search(r"^run id [0-9a-f]{16}$", done.stderr, re.MULTILINE)


def test_reap_command_closes_a_crashed_run_and_spares_a_live_one(tmp_path: Path, sandbox_base: Path) -> None:
    """reap lists (--dry-run) and then closes exactly the killed worker's sandboxes, each by id."""
    config = _config(tmp_path, sandbox_base)
    crashed = anyio.run(crashed_worker, [sys.executable, "-c", _WORKER, str(sandbox_base), "crashed-run"])

    async def live_run() -> tuple[LocalProvider, list[SandboxHandle]]:
        local = LocalProvider(isolation="none", base_dir=sandbox_base)
        live = stack(local, [Middleware(OwnershipMiddleware, run_id="live-run")])
        return local, [await live.create(SandboxSpec()) for _ in range(2)]

    async def close_all() -> None:
        for handle in handles:
            await local.close(handle)
        await local.aclose()

    local, handles = anyio.run(live_run)
    mine = {handle.sandbox_id for handle in handles}
    try:
        preview = run("reap", str(config), "--dry-run")
        assert preview.returncode == 0, preview.stderr
        assert {line.split()[0] for line in preview.stdout.splitlines()} == crashed
        assert all("would close" in line for line in preview.stdout.splitlines())
        assert f"{len(crashed)} sandbox(es) found" in preview.stderr

        spared = run("reap", str(config), "--run", "live-run")  # its owner (this process) is alive
        assert spared.returncode == 0 and spared.stdout == ""

        done = run("reap", str(config), "--run", "crashed-run")
        assert done.returncode == 0, done.stderr
        assert {line.split()[0] for line in done.stdout.splitlines()} == crashed
        assert all(" closed  run crashed-run" in line for line in done.stdout.splitlines())
        remaining = {listing.handle.sandbox_id for listing in anyio.run(local.list)}
        assert remaining == mine
    finally:
        anyio.run(close_all)


def test_reap_command_leaves_a_trainer_of_another_pid_namespace_alone_and_says_so(
    tmp_path: Path, sandbox_base: Path
) -> None:
    """A live trainer with the host's hostname in a PID namespace of its own: reap lists each of its
    sandboxes as left alone, of unknown liveness (exit 0: nothing it chose failed); --force takes them."""
    config = _config(tmp_path, sandbox_base)
    argv = in_own_pid_namespace([sys.executable, "-c", _WORKER, str(sandbox_base), "ns-run", "unbounded"])

    async def check() -> None:
        async with live_worker(argv) as made:
            for arguments in ((), ("--run", "ns-run")):
                left = await anyio.to_thread.run_sync(partial(run, "reap", str(config), *arguments))
                assert left.returncode == 0, left.stderr
                assert {line.split()[0] for line in left.stdout.splitlines()} == made
                assert all(
                    "  left alone  run ns-run  owner " in line
                    and "liveness unknown: " in line
                    and "PID namespace" in line
                    for line in left.stdout.splitlines()
                ), left.stdout
                assert "0 sandbox(es) closed, 3 left alone (owner liveness unknown here" in left.stderr
            forced = await anyio.to_thread.run_sync(partial(run, "reap", str(config), "--run", "ns-run", "--force"))
            assert forced.returncode == 0, forced.stderr
            assert {line.split()[0] for line in forced.stdout.splitlines()} == made
            assert all("  closed  run ns-run" in line for line in forced.stdout.splitlines())
            assert not [path for path in sandbox_base.iterdir() if path.name[:18] in made]

    anyio.run(check)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--force"], "argument --force: needs --run ID"),
    ],
)
def test_reap_usage_errors(tmp_path: Path, sandbox_base: Path, arguments: list[str], message: str) -> None:
    done = run("reap", str(_config(tmp_path, sandbox_base)), *arguments)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.splitlines()) == 1


def test_ray_option_without_a_cluster_is_one_clear_error() -> None:
    """--ray at an address where nothing listens fails at once (exit 2) naming the fix; without ray, the extra."""
    done = run("run", "--ray", f"127.0.0.1:{free_port()}", "--sessions", "1")
    assert done.returncode == 2
    if importlib.util.find_spec("ray") is None:
        assert "argument --ray: needs the 'ray' extra" in done.stderr
    else:
        assert "argument --ray: cannot connect to a Ray cluster at 127.0.0.1:" in done.stderr
        assert "ray start --head" in done.stderr


def test_reap_command_shows_the_snapshots_it_deletes_and_leaves(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a provider that takes snapshots (the in-memory one, registered under a name): a crashed run's
    snapshot is listed (--dry-run) and then deleted, each line saying it is a snapshot; one of unknown
    liveness is left alone and said so; the summary counts them apart from the sandboxes."""
    memory = FaultInjectingProvider()
    monkeypatch.setitem(provider_registry._registered, "memory-reap-test", None)  # undone after the test
    register_provider("memory-reap-test", lambda: memory, replace=True)
    crashed = {"sandbox_middleware.run_id": "crashed", **dead_owner_stamp()}

    async def snapshots() -> tuple[str, str, str]:
        parent = await memory.create(SandboxSpec())
        dead = await memory.snapshot(parent, metadata=crashed)
        elsewhere = {**crashed, "sandbox_middleware.owner.host": "another-host"}
        unsure = await memory.snapshot(parent, metadata=elsewhere)
        sandbox = await memory.create(SandboxSpec(metadata=crashed))
        return dead.snapshot_id, unsure.snapshot_id, sandbox.sandbox_id

    dead, unsure, sandbox = anyio.run(snapshots)
    assert main(["reap", "--provider", "memory-reap-test", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(lines) == {dead, unsure, sandbox}
    assert f"{dead}  snapshot  would delete  run crashed  owner " in lines[dead]
    assert f"{sandbox}  would close  run crashed" in lines[sandbox]
    assert f"{unsure}  snapshot  left alone  run crashed" in lines[unsure] and "another host" in lines[unsure]
    assert "1 sandbox(es) found; 1 snapshot(s) found, 1 left alone (owner liveness unknown here" in err
    assert len(anyio.run(memory.list_snapshots)) == 2

    assert main(["reap", "--provider", "memory-reap-test"]) == 0
    out, err = capsys.readouterr()
    assert f"{dead}  snapshot  deleted  run crashed" in out and f"{sandbox}  closed  run crashed" in out
    assert "1 sandbox(es) closed; 1 snapshot(s) deleted, 1 left alone" in err
    assert [snapshot.snapshot_id for snapshot in anyio.run(memory.list_snapshots)] == [unsure]


def test_reap_command_exits_1_when_a_snapshot_cannot_be_deleted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = FaultInjectingProvider(failure_rates={"delete_snapshot": 1.0})
    monkeypatch.setitem(provider_registry._registered, "memory-reap-test", None)
    register_provider("memory-reap-test", lambda: memory, replace=True)
    crashed = {"sandbox_middleware.run_id": "crashed", **dead_owner_stamp()}

    async def snapshot() -> str:
        return (await memory.snapshot(await memory.create(SandboxSpec()), metadata=crashed)).snapshot_id

    stuck = anyio.run(snapshot)
    assert main(["reap", "--provider", "memory-reap-test", "--run", "crashed"]) == 1
    out, err = capsys.readouterr()
    assert f"{stuck}  snapshot  NOT deleted (InjectedFault: injected delete_snapshot failure)" in out
    assert "0 sandbox(es) closed; 0 snapshot(s) deleted, 1 could not be deleted" in err
