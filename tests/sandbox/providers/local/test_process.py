"""A process group kept past its leader is killed only while it is still the group that was seen alive:
its number, once free, may be another program's (pid_max 32768 wraps within minutes under load)."""

from __future__ import annotations

import subprocess
import time

from sandbox_middleware.providers.local._process import alive_ticks, group_alive, kill_group


def _stranger() -> subprocess.Popen[bytes]:
    """A program of someone else's leading its own group, as a Ray raylet does."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_a_group_number_seen_alive_before_its_processes_began_is_never_signalled() -> None:
    """Seen alive at ``alive_at``, then every process of it ended; the number now leads a stranger's
    group, every process of which is younger: not signalled."""
    seen = alive_ticks()
    time.sleep(0.05)  # at least one clock tick (10 ms) between the last sighting and the stranger's start
    stranger = _stranger()
    try:
        kill_group(stranger.pid, seen)
        time.sleep(0.1)
        assert stranger.poll() is None and group_alive(stranger.pid)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_group_with_a_process_as_old_as_its_sighting_is_killed() -> None:
    """A process of the group was alive when it was last seen: the group is still the one seen, and dies."""
    member = _stranger()
    try:
        time.sleep(0.05)
        kill_group(member.pid, alive_ticks())
        assert member.wait(timeout=10) == -9
    finally:
        member.kill()
        member.wait()


def test_without_a_sighting_the_group_is_killed_at_once() -> None:
    """A group whose leader is still ours (not yet waited for) needs no check."""
    member = _stranger()
    kill_group(member.pid)
    assert member.wait(timeout=10) == -9
    kill_group(member.pid, alive_ticks())  # gone: nothing to signal, no error
