"""Spare containers (``docker/_spares.py``) on the real daemon: a create of the last shape takes the one
made ahead, with the caller's spec applied; no listing shows an untaken spare; another shape is never
served it; aclose, staleness, a changed image and the next provider after a SIGKILLed maker remove it.
A spare has a host uid of its own, its taker's, freed when it is removed untaken."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import anyio
import pytest

from sandbox_middleware import DockerProvider, SandboxStatus
from sandbox_middleware.providers._common import _uids
from sandbox_middleware.providers.docker._container import UID
from sandbox_middleware.providers.docker._ttl import taken_at

from ._support import (
    BUSYBOX,
    PYTHON,
    RUNTIME,
    SESSION,
    SESSION_KEY,
    TAG,
    claim_of,
    engine,
    engine_kind,
    memory_cgroup,
    on_daemon,
    one_spare,
    spares_on_daemon,
    tagged,
)

pytestmark = pytest.mark.anyio


async def gone(container: str, timeout_s: float = 60.0) -> None:
    with engine() as client, anyio.fail_after(timeout_s):
        while client.get(f"/containers/{container}/json").status_code != 404:
            await anyio.sleep(0.1)


async def test_a_second_create_of_the_same_shape_takes_the_spare_started_with_the_callers_spec(
    provider: DockerProvider,
) -> None:
    tag = uuid.uuid4().hex[:8]
    shape = {"env": {"SECRET": "s3"}, "workdir": "project", "ttl_s": 600}
    first = await provider.create(tagged(tag, files={"a.txt": "first"}, **shape))
    spare = await one_spare(tag, kept_by=provider)
    assert spare["Id"] != first.sandbox_id
    assert [listed.handle.sandbox_id for listed in await provider.list(metadata={TAG: tag})] == [first.sandbox_id]

    before = time.time()
    second = await provider.create(tagged(tag, files={"b.txt": "second"}, **shape))
    assert second.sandbox_id == spare["Id"]  # that very container, started before this create began
    with engine() as client:
        info = client.get(f"/containers/{second.sandbox_id}/json").json()
    started = datetime.fromisoformat(info["State"]["StartedAt"][:26] + "+00:00").timestamp()
    assert info["State"]["Running"] and started < before
    taken = taken_at(info["Name"])
    assert taken is not None and before - 1 <= taken[0] <= time.time() + 1
    assert taken[1] is not None and abs(taken[1] - (taken[0] + 600)) < 2  # its TTL counts from the take
    result = await provider.exec(second, "echo $SECRET; pwd; cat b.txt; echo; ls")
    assert (result.return_code, result.stdout.split()) == (0, ["s3", "/workspace/project", "second", "b.txt"])
    assert await provider.status(second) == SandboxStatus.RUNNING
    listed = {entry.handle.sandbox_id: entry for entry in await provider.list(metadata={TAG: tag})}
    assert set(listed) == {first.sandbox_id, second.sandbox_id}  # taken, it is the caller's
    assert listed[second.sandbox_id].metadata == {SESSION_KEY: SESSION, TAG: tag}
    assert listed[second.sandbox_id].created_at == pytest.approx(taken[0])
    descriptor = await provider.serialize_handle(second)
    other = DockerProvider(connect_key=provider._key, prestart=False)
    try:  # another process reads its deadline from its name
        await other.connect(descriptor)
        assert other._boxes[second.sandbox_id].deadline == pytest.approx(taken[1])
    finally:
        await other.aclose()
    for handle in (first, second):
        await provider.close(handle)
    await one_spare(tag)  # the next one, made behind it


async def freed(uid: int, timeout_s: float = 30.0) -> None:
    """Until the lease of ``uid`` is claimed by nothing (an untaken spare's is freed in the maker thread)."""
    with anyio.fail_after(timeout_s):
        while claim_of(uid) is not None:
            await anyio.sleep(0.05)


async def test_a_spare_runs_as_a_uid_of_its_own_which_its_taker_keeps_and_a_discard_frees(
    make: Callable[..., DockerProvider], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare is made as any sandbox: a host uid leased and claimed for it (by id), the host pools'
    bounds (nofile, nproc, ptys, the TCP buffers written after its start). Taken, by a rename, it
    keeps that claim and runs the caller's commands as that uid, not another live sandbox's; its
    close frees it. An untaken spare's uid is freed when it is removed: served to no create of
    another shape, or at aclose."""
    tag = uuid.uuid4().hex[:8]
    ptys = 0 if "podman" in (engine_kind(), RUNTIME) or RUNTIME == "runsc" else 4  # devpts: runc's alone
    provider = make(nofile=128, ptys=ptys)
    first = await provider.create(tagged(tag))
    own = int((await provider.exec(first, "id -u")).stdout)
    spare = await one_spare(tag, kept_by=provider)
    uid = int(spare["Labels"][UID])
    assert uid != own and claim_of(uid) == spare["Id"] and claim_of(own) == first.sandbox_id
    with engine() as client:
        made, direct = (client.get(f"/containers/{c}/json").json() for c in (spare["Id"], first.sandbox_id))
    assert made["Config"]["User"] == f"{uid}:{uid}" and direct["Config"]["User"] == f"{own}:{own}"
    assert made["HostConfig"]["Ulimits"] == direct["HostConfig"]["Ulimits"]  # nofile, nproc
    soft = {u["Name"].lower().removeprefix("rlimit_"): u["Soft"] for u in made["HostConfig"]["Ulimits"]}
    assert soft["nofile"] == 128  # Podman's inspect spells it RLIMIT_NOFILE
    if "v1 memory.kmem.tcp" in provider.mechanisms["tcp buffers"]:  # cgroup v1, root beside the daemon
        assert int((memory_cgroup(spare["Id"]) / "memory.kmem.tcp.limit_in_bytes").read_text()) == 64 << 20

    second = await provider.create(tagged(tag))
    assert second.sandbox_id == spare["Id"]
    result = await provider.exec(second, f"id -u; id -g; ulimit -n; grep -c 'devpts.*max={ptys}' /proc/mounts")
    assert result.stdout.split() == [str(uid), str(uid), "128", "1" if ptys else "0"]
    assert int((await provider.exec(first, "id -u")).stdout) == own
    assert claim_of(uid) == spare["Id"]  # the rename left its claim, by id
    monkeypatch.setattr(_uids, "draw", lambda: uid)
    lease = _uids.lease_uid(_uids.lease_directory())  # the pool skips it though no process locks it
    monkeypatch.undo()
    assert lease.uid not in (uid, own)
    lease.release()
    await provider.close(second)
    await freed(uid)  # Podman: the close's release can trail the answer (seen once in CI)

    untaken = await one_spare(tag, kept_by=provider)  # made behind the take
    other = await provider.create(tagged(tag, env={"A": "2"}))  # another shape: the spare is removed
    assert other.sandbox_id != untaken["Id"]
    await gone(untaken["Id"])
    await freed(int(untaken["Labels"][UID]))
    last = await one_spare(tag)  # of that shape
    for handle in (first, other):
        await provider.close(handle)
    await provider.aclose()
    assert on_daemon(tag) == [] and claim_of(int(last["Labels"][UID])) is None
    assert claim_of(own) is None


async def test_a_create_of_another_shape_is_never_served_the_spare(provider: DockerProvider) -> None:
    tag = uuid.uuid4().hex[:8]
    await provider.close(await provider.create(tagged(tag, env={"A": "1"})))
    old = await one_spare(tag, kept_by=provider)
    for other in (
        tagged(tag, env={"A": "2"}),
        tagged(tag, env={"A": "1"}, metadata={"more": "x"}),
        tagged(tag, env={"A": "1"}, resources={"memory_mib": 256}),
        tagged(tag, env={"A": "1"}, image=PYTHON),
    ):
        handle = await provider.create(other)
        assert handle.sandbox_id != old["Id"]
        await gone(old["Id"])  # the spare of the shape before is removed, one of this shape made
        old = await one_spare(tag, kept_by=provider)
        await provider.close(handle)
    assert [c["Id"] for c in on_daemon(tag)] == [old["Id"]]


async def test_aclose_removes_the_spare_and_prestart_false_makes_none(make: Callable[..., DockerProvider]) -> None:
    tag = uuid.uuid4().hex[:8]
    provider = make()
    await provider.close(await provider.create(tagged(tag)))
    spare = await one_spare(tag)
    with anyio.CancelScope() as scope:  # cancelled at once: the removal is shielded
        scope.cancel()
        await provider.aclose()
    assert on_daemon(tag) == [] and spare["Id"]
    cold = make(prestart=False)
    await cold.close(await cold.create(tagged(tag)))
    await anyio.sleep(1)
    assert on_daemon(tag) == []


async def test_a_create_cancelled_while_it_takes_the_spare_removes_it(
    provider: DockerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = uuid.uuid4().hex[:8]
    await provider.close(await provider.create(tagged(tag)))
    spare = await one_spare(tag, kept_by=provider)

    async def hangs(image: str) -> None:
        await anyio.sleep_forever()

    monkeypatch.setattr(provider, "_inspect_image", hangs)  # the take's first look (the plan's is cached)
    with anyio.move_on_after(1) as scope:
        await provider.create(tagged(tag))
    assert scope.cancelled_caught
    await gone(spare["Id"])  # nobody holds it: removed, not left to its staleness


async def test_a_stale_spare_is_removed_and_never_handed_out(make: Callable[..., DockerProvider]) -> None:
    """Past spare_ttl_s the watchdog removes a spare whose maker lives; a create takes none near that."""
    tag = uuid.uuid4().hex[:8]
    provider = make(spare_ttl_s=10)
    await provider.close(await provider.create(tagged(tag)))
    young = await one_spare(tag, kept_by=provider)
    handle = await provider.create(tagged(tag))
    assert handle.sandbox_id == young["Id"]  # within the first half of its 10 s
    await provider.close(handle)
    spare = await one_spare(tag, kept_by=provider)
    await anyio.sleep(6)  # within the margin before its staleness (half of 10 s): not handed out
    handle = await provider.create(tagged(tag))
    assert handle.sandbox_id != spare["Id"]
    await provider.close(handle)
    await gone(spare["Id"], 30)
    fresh = await one_spare(tag)
    await gone(fresh["Id"], 30)  # nobody takes it: the watchdog removes it once stale


async def test_a_spare_of_an_image_since_replaced_is_not_handed_out(make: Callable[..., DockerProvider]) -> None:
    tag = uuid.uuid4().hex[:8]
    image = f"sandbox-middleware/spare-{tag}:test"
    repository, _, version = image.partition(":")
    with engine() as client:
        client.post(f"/images/{BUSYBOX}/tag", params={"repo": repository, "tag": version}).raise_for_status()
    try:
        provider = make()
        await provider.close(await provider.create(tagged(tag, image=image)))
        spare = await one_spare(tag, kept_by=provider)
        with engine() as client:
            client.post(f"/images/{PYTHON}/tag", params={"repo": repository, "tag": version}).raise_for_status()
        handle = await provider.create(tagged(tag, image=image))
        assert handle.sandbox_id != spare["Id"]
        assert (await provider.exec(handle, "command -v python3")).return_code == 0  # the image it names now
        await gone(spare["Id"])
        await provider.aclose()
    finally:
        with engine() as client:
            client.delete(f"/images/{image}")


MAKER = """
import sys, anyio
from sandbox_middleware import DockerProvider, SandboxSpec
async def main():
    provider = DockerProvider()
    metadata = {%(session_key)r: %(session)r, %(tag_key)r: sys.argv[1]}
    await provider.close(await provider.create(SandboxSpec(image=%(image)r, metadata=metadata)))
    assert await anyio.to_thread.run_sync(provider._spares.wait, 60.0)
    print("ready", flush=True)
    await anyio.sleep(3600)
anyio.run(main)
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one backend is enough for a process killed on purpose
@pytest.mark.parametrize("next_one", ["provider", "reap"])
async def test_a_sigkilled_makers_spare_is_removed_by_the_next_provider_or_reap(docker: None, next_one: str) -> None:
    tag = uuid.uuid4().hex[:8]
    script = MAKER % {"session_key": SESSION_KEY, "session": SESSION, "tag_key": TAG, "image": BUSYBOX}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    async with await anyio.open_process([sys.executable, "-c", script, tag], env=env) as maker:
        assert maker.stdout is not None
        with anyio.fail_after(120):
            assert (await maker.stdout.receive()).strip() == b"ready"
        maker.send_signal(signal.SIGKILL)
        await maker.wait()
    [spare] = spares_on_daemon(tag)  # left running by nobody
    uid = int(spare["Labels"][UID])
    assert claim_of(uid) == spare["Id"]
    if next_one == "reap":  # the command's provider, made on this daemon, removes it
        argv = [sys.executable, "-m", "sandbox_middleware", "reap", "--provider", "docker", "--run", f"none-{tag}"]
        done = await anyio.run_process(argv, env=env, check=False)
        assert done.returncode == 0, done.stderr
        assert on_daemon(tag) == [] and claim_of(uid) is None  # its uid freed with it
        return
    following = DockerProvider(prestart=False)  # the next provider on this daemon removes it, at construction
    try:
        assert on_daemon(tag) == [] and spare["State"] == "running"
        assert claim_of(uid) is None
    finally:
        await following.aclose()
