"""``Owner.liveness``, the one rule reap, the admission ledger and LocalProvider's spares and maker
files use: alive or dead only from the owner's host, boot and PID namespace; unknown from anywhere else."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from sandbox_middleware._owner import Owner
from sandbox_middleware.middleware.admission._ledger import _dead, owner_key
from tests.providers import in_own_pid_namespace


def _dead_owner() -> Owner:
    """The stamp of a real process that has exited (and been waited for)."""
    code = "import json; from sandbox_middleware._owner import Owner; print(json.dumps(Owner.current().metadata()))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    owner = Owner.from_metadata(json.loads(child.stdout))
    assert owner is not None and owner.pidns is not None
    return owner


def test_an_owner_is_alive_or_dead_only_in_its_own_host_boot_and_pid_namespace() -> None:
    me = Owner.current()
    assert me.liveness().alive is True and me.pidns == os.readlink("/proc/self/ns/pid")
    assert Owner.from_metadata(me.metadata()) == me
    gone = _dead_owner()
    assert gone.liveness() == (False, f"owner {gone} is no longer alive")
    boot, _, _ = me.started.partition(":")
    reused = dataclasses.replace(me, started=f"{boot}:1")  # this pid, another start: the pid was reused
    assert reused.alive() is False
    elsewhere = {
        "another host": dataclasses.replace(gone, host=gone.host + "-other"),
        "not this one": dataclasses.replace(gone, started="0" * 8 + gone.started[8:]),
        "PID namespace": dataclasses.replace(gone, pidns="pid:[1]"),
        "without its PID namespace": dataclasses.replace(gone, pidns=None),  # a stamp of before
    }
    for why, owner in elsewhere.items():
        alive, said = owner.liveness()
        assert alive is None and why in said, (why, said)
    assert dataclasses.replace(me, pidns=None).alive() is True  # an old stamp of a process found here


def test_the_admission_ledger_frees_only_the_slots_of_owners_found_dead() -> None:
    assert not _dead(owner_key())
    assert _dead(owner_key(_dead_owner()))
    assert not _dead(owner_key(dataclasses.replace(_dead_owner(), pidns="pid:[1]")))
    gone = _dead_owner()
    assert not _dead(f"{gone.host}|{gone.pid}|{gone.started}")  # a key of before: its namespace unknown


def test_a_process_whose_proc_is_of_another_pid_namespace_tells_nothing() -> None:
    """In a PID namespace of its own but the host's /proc (unshare without --mount-proc), the pids
    /proc shows are not the process's: it cannot tell whether anyone lives, itself included."""
    code = "from sandbox_middleware._owner import Owner; print(Owner.current().liveness())"
    argv = in_own_pid_namespace([sys.executable, "-c", code])
    argv.remove("--mount-proc")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "alive=None" in done.stdout and "/proc is of another PID namespace" in done.stdout
