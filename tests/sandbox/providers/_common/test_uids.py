"""The host uid leases (``_uids.py``) in a directory of the test's own: a lease whose maker was killed is
swept, a live one and a container's claim are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sandbox_middleware.providers._common import _uids

_KILLED = """
import os, signal, sys
from pathlib import Path
from sandbox_middleware.providers._common import _uids
print(_uids.lease_uid(Path(sys.argv[1])).uid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as an OOM kill would: the lock goes, the file stays
"""


def test_a_killed_maker_s_lease_is_swept_and_live_leases_and_claims_are_kept(tmp_path: Path) -> None:
    directory = tmp_path / "uids"
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(directory)], capture_output=True, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    stale = directory / killed.stdout.decode().strip()
    assert stale.exists()
    live = _uids.lease_uid(directory)
    claimed = _uids.lease_uid(directory)
    claimed.claim("/run/docker.sock", "some-container")
    claimed.keep()  # unlocked: the container's now
    (directory / "notes").write_text("not a lease")
    try:
        _uids.sweep_leases(directory)
        assert sorted(os.listdir(directory)) == sorted([str(live.uid), str(claimed.uid), "notes"])
    finally:
        live.release()


def test_sweeping_a_missing_or_foreign_directory_does_nothing(tmp_path: Path) -> None:
    _uids.sweep_leases(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "1500000001").write_text("1\n")
    _uids.sweep_leases(shared)  # not a private lease directory: not ours to change
    assert (shared / "1500000001").exists()
