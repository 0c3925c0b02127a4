"""DockerProvider on the real daemon: the seven operations, the capabilities, labels, typed errors."""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from sandbox_middleware import (
    CAPABILITIES,
    DockerProvider,
    DockerUnavailableError,
    SandboxArgumentError,
    SandboxCreateError,
    SandboxError,
    SandboxHandle,
    SandboxImageNotFoundError,
    SandboxLimitError,
    SandboxNotFoundError,
    SandboxPathError,
    SandboxStatus,
    SupportsSandboxList,
    SupportsSandboxPauseResume,
    build_provider,
)
from sandbox_middleware.providers._common import _uids

from ._support import PYTHON, RUNTIME, SESSION, SESSION_KEY, cannot_hold, containers, require_bridge, spec

pytestmark = pytest.mark.anyio


async def test_exec_output_exit_code_env_cwd(provider: DockerProvider) -> None:
    """stdout, stderr and the exit code apart; the spec's env, the call's env, the workdir and cwd."""
    handle = await provider.create(spec(env={"A": "spec", "B": "spec"}, workdir="work"))
    result = await provider.exec(handle, 'echo "$A $B $PWD"; echo oops >&2; exit 3', env={"B": "call"})
    assert (result.stdout, result.stderr, result.return_code, result.error_type) == (
        "spec call /workspace/work\n", "oops\n", 3, None,
    )  # fmt: skip
    await provider.exec(handle, "mkdir sub")
    assert (await provider.exec(handle, "pwd", cwd="sub")).stdout == "/workspace/work/sub\n"
    assert (await provider.exec(handle, "pwd", cwd="/tmp")).stdout == "/tmp\n"
    await provider.close(handle)


async def test_a_missing_cwd_is_an_error_naming_it(provider: DockerProvider) -> None:
    cannot_hold(
        "podman",
        "Podman reports an exec that cannot start as the command's exit 127, the runtime's words on its stderr; "
        "only exec inspect's Pid 0 tells them apart (issue 29 item 3)",
    )
    handle = await provider.create(spec(workdir="work"))
    with pytest.raises(SandboxError, match=re.escape("cwd '/workspace/work/nowhere'")):
        await provider.exec(handle, "true", cwd="nowhere")
    await provider.close(handle)


async def test_a_command_silent_longer_than_the_request_timeout_runs_to_its_end(
    make: Callable[..., DockerProvider],
) -> None:
    """request_timeout_s bounds each API request, not a command's silence: the exec stream has no
    read timeout (an ExceptionGroup of httpx's ReadTimeout escaped after request_timeout_s)."""
    provider = make(request_timeout_s=1)
    handle = await provider.create(spec())
    result = await provider.exec(handle, "sleep 2.5; echo done", timeout_s=30)
    assert (result.stdout, result.return_code, result.error_type) == ("done\n", 0, None)
    await provider.close(handle)


async def test_each_sandbox_runs_as_a_host_uid_of_its_own_whatever_the_image_user(provider: DockerProvider) -> None:
    """The busybox image sets no USER, the python image's is ``sandbox``: both run as a uid (and gid) of
    their own, from the host's pool; exec(user=) takes that uid and refuses root in any spelling."""
    handle = await provider.create(spec())
    python = await provider.create(spec(PYTHON))
    ids = [(await provider.exec(box, "id -u; id -g; id -G")).stdout.split() for box in (handle, python)]
    assert all(uid == gid == groups for uid, gid, groups in ids), ids
    uids = [int(uid) for uid, _, _ in ids]
    assert uids[0] != uids[1] and all(_uids.UID_BASE <= uid < _uids.UID_BASE + _uids.UID_COUNT for uid in uids)
    own = await provider.exec(handle, "id -u", user=uids[0])
    assert own.stdout == f"{uids[0]}\n"
    assert (await provider.exec(handle, "id -u", user=f"{uids[0]}:{uids[0]}")).stdout == f"{uids[0]}\n"
    for root in ("root", 0, "0", "0:0", "root:root", "0:1000", "00", "0x0", "+0", "\u0660", uids[1], "nobody"):
        with pytest.raises(SandboxArgumentError, match="runs every command as host uid:gid"):
            await provider.exec(handle, "id -u", user=root)
    await provider.close(handle)
    await provider.close(python)


async def test_files_workdir_and_transfers(provider: DockerProvider, tmp_path: Path) -> None:
    """spec.files land in the work directory; uploads make parents, downloads come back byte for byte,
    both in the work directory and in /tmp, owned by the sandbox's user."""
    handle = await provider.create(spec(files={"src/solve.sh": "echo 42\n", "/tmp/note": "n"}))
    assert (await provider.exec(handle, "sh src/solve.sh; cat /tmp/note")).stdout == "42\nn"
    source = tmp_path / "in.bin"
    source.write_bytes(b"\x00\x01payload" * 1000)
    await provider.upload_file(handle, source, "data/deep/in.bin")
    await provider.upload_file(handle, source, "/tmp/in.bin")
    listing = await provider.exec(handle, "stat -c '%u %s' data/deep/in.bin /tmp/in.bin; echo more >> data/deep/in.bin")
    uid = (await provider.exec(handle, "id -u")).stdout.strip()
    assert listing.stdout == f"{uid} 9000\n{uid} 9000\n" and listing.return_code == 0
    await provider.download_file(handle, "/tmp/in.bin", tmp_path / "back" / "in.bin")
    assert (tmp_path / "back" / "in.bin").read_bytes() == source.read_bytes()
    await provider.download_file(handle, "data/deep/in.bin", tmp_path / "grown.bin")
    assert (tmp_path / "grown.bin").read_bytes() == source.read_bytes() + b"more\n"
    with pytest.raises(SandboxError, match=re.escape("'missing.txt' is not a file")):
        await provider.download_file(handle, "missing.txt", tmp_path / "x")
    with pytest.raises(SandboxError, match="cannot upload"):
        await provider.upload_file(handle, tmp_path / "missing", "x")
    await provider.close(handle)


@pytest.mark.parametrize("path", ["../escape", "a/../../escape", "/etc/passwd", "/workspace/../etc/x"])
async def test_paths_outside_the_writable_directories_are_refused(
    provider: DockerProvider, tmp_path: Path, path: str
) -> None:
    handle = await provider.create(spec())
    (tmp_path / "in").write_text("x")
    with pytest.raises(SandboxPathError):
        await provider.upload_file(handle, tmp_path / "in", path)
    with pytest.raises(SandboxPathError):
        await provider.download_file(handle, path, tmp_path / "out")
    await provider.close(handle)


async def test_status_close_and_unknown_handles(provider: DockerProvider) -> None:
    """close removes the container and its volumes; closing again does nothing; operations after it are typed."""
    handle = await provider.create(spec())
    assert await provider.status(handle) == SandboxStatus.RUNNING
    [container] = [c for c in containers() if c == handle.sandbox_id]
    await provider.close(handle)
    await provider.close(handle)
    assert container not in containers()
    assert await provider.status(handle) == SandboxStatus.STOPPED
    with pytest.raises(SandboxNotFoundError, match="no live sandbox"):
        await provider.exec(handle, "true")


async def test_closing_one_sandbox_from_two_providers_at_once_is_quiet(make: Callable[..., DockerProvider]) -> None:
    """The second DELETE of a container being removed answers 409 "already in progress": close is
    idempotent, so that is done, not an error (it raised EngineError: the TTL watchdog or a reaper
    removing a sandbox while its owner closes it hit the same)."""
    first, second = make(), make()
    for _ in range(3):
        handle = await first.create(spec())
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(first.close, handle)
            tasks.start_soon(second.close, SandboxHandle(handle.sandbox_id, "docker"))
        assert await first.status(handle) is SandboxStatus.STOPPED


async def test_a_start_failing_with_the_daemon_gone_is_a_create_error(
    provider: DockerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the start fails and so does the removal after it (the daemon died), the create still
    raises SandboxCreateError, which a retry layer retries (the removal's DockerUnavailableError
    replaced it)."""
    removed: list[str] = []
    real_remove = provider._remove

    async def gone(*args: object) -> None:
        raise DockerUnavailableError("the daemon went away")

    async def remove_fails(container: str, *api: Any) -> None:
        removed.append(container)
        await real_remove(container, *api)  # the test leaves nothing behind
        raise DockerUnavailableError("the daemon went away")

    monkeypatch.setattr(provider, "_seed", gone)
    monkeypatch.setattr(provider, "_remove", remove_fails)
    with pytest.raises(SandboxCreateError, match="cannot start a container"):
        await provider.create(spec())
    assert len(removed) == 1


async def test_a_failed_close_leaves_a_sandbox_that_says_it_runs(
    provider: DockerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close whose removal failed (the daemon went away) left the sandbox marked closed: status
    said STOPPED of a running container, and exec refused it as closed."""
    handle = await provider.create(spec())
    real_remove = provider._remove

    async def gone(container: str, api: object = None, files: str | None = None) -> None:
        raise DockerUnavailableError("the daemon went away")

    monkeypatch.setattr(provider, "_remove", gone)
    with pytest.raises(DockerUnavailableError):
        await provider.close(handle)
    assert await provider.status(handle) is SandboxStatus.RUNNING
    assert (await provider.exec(handle, "echo still")).stdout == "still\n"
    monkeypatch.setattr(provider, "_remove", real_remove)
    await provider.close(handle)
    assert await provider.status(handle) is SandboxStatus.STOPPED


async def test_a_missing_image_is_a_typed_error_naming_it(provider: DockerProvider) -> None:
    """Not a SandboxCreateError: retrying cannot help, and nothing is pulled."""
    with pytest.raises(
        SandboxImageNotFoundError, match=re.escape("'sandbox-middleware/nothing:here' is not on the daemon")
    ):
        await provider.create(spec("sandbox-middleware/nothing:here"))
    with pytest.raises(SandboxArgumentError, match=re.escape("spec.image")):
        await provider.create(spec(image=""))


@pytest.mark.parametrize("user", ["auto", "1000"])
async def test_pull_is_asked_once_whatever_the_user_and_then_trusted_no_further(
    make: Callable[..., DockerProvider], monkeypatch: pytest.MonkeyPatch, user: str
) -> None:
    """Whatever the user, a pull that left no image under that name is not asked again without end."""
    provider = make(pull=True, user=user)
    pulled: list[str] = []

    async def pull(image: str) -> None:  # a pull that reports success and leaves no such image
        pulled.append(image)

    monkeypatch.setattr(provider, "_pull_image", pull)
    with pytest.raises(SandboxImageNotFoundError, match="pulled image 'sandbox-middleware/nothing:here', yet"):
        await provider.create(spec("sandbox-middleware/nothing:here"))
    assert pulled == ["sandbox-middleware/nothing:here"]


async def test_bad_arguments_are_typed_errors_naming_them(make: Callable[..., DockerProvider]) -> None:
    with pytest.raises(SandboxArgumentError, match="memory_mib"):
        make(memory_mib=-1)
    with pytest.raises(DockerUnavailableError, match=re.escape("no Docker daemon answers at /nowhere.sock")):
        make(socket="/nowhere.sock")
    with pytest.raises(DockerUnavailableError, match=re.escape("api_version '1.99'")):
        make(api_version="1.99")
    for user in ("root", "0", "0:0", "00", "1000:0", "sandbox", "0x0", "\u0661"):
        with pytest.raises(SandboxArgumentError, match=re.escape("must be 'auto'")):
            make(user=user)
    with pytest.raises(SandboxArgumentError, match="range sandboxes' own uids are leased from"):
        make(user=f"{_uids.UID_BASE + 5}:1000")
    for name in ("nofile", "ptys", "tcp_mib"):
        with pytest.raises(SandboxArgumentError, match=name):
            make(**{name: -1})
    provider = make()
    with pytest.raises(SandboxLimitError, match="no GPUs"):
        await provider.create(spec(resources={"gpu": 1}))
    with pytest.raises(SandboxArgumentError, match="need a network"):
        await provider.create(spec(ports=[8000]))
    with pytest.raises(SandboxArgumentError, match=re.escape("spec.metadata key")):
        await provider.create(spec(metadata={"a=b": "c"}))


async def test_api_version_is_negotiated_or_as_asked(make: Callable[..., DockerProvider]) -> None:
    assert make().api_version == "1.41"  # this machine's daemon; ours goes to 1.43
    assert make(api_version="1.40").api_version == "1.40"


async def test_list_by_metadata_and_close_a_listed_handle(make: Callable[..., DockerProvider]) -> None:
    """Listing finds sandboxes by label from another provider instance (a process of its own would too)."""
    maker, finder = make(), make()
    mine = await maker.create(spec(metadata={"role": "a"}))
    other = await maker.create(spec(metadata={"role": "b"}))
    [listed] = await finder.list(metadata={SESSION_KEY: SESSION, "role": "a"})
    assert listed.handle.sandbox_id == mine.sandbox_id and listed.metadata["role"] == "a"
    assert listed.created_at is not None
    await finder.close(listed.handle)
    assert {listing.handle.sandbox_id for listing in await finder.list(metadata={SESSION_KEY: SESSION})} == {
        other.sandbox_id
    }
    await maker.close(other)


async def test_serialize_and_connect_across_providers(make: Callable[..., DockerProvider]) -> None:
    key = b"k" * 32
    first, second, stranger = make(connect_key=key), make(connect_key=key), make()
    handle = await first.create(spec(workdir="w", env={"E": "1"}))
    descriptor = await first.serialize_handle(handle)
    again = await second.connect(descriptor)
    assert (await second.exec(again, "echo $E $PWD")).stdout == "1 /workspace/w\n"
    with pytest.raises(SandboxError, match="signature does not match"):
        await stranger.connect(descriptor)
    with pytest.raises(SandboxError, match="signature does not match"):
        await second.connect({**descriptor, "sandbox_id": "0" * 64})
    await second.close(again)
    with pytest.raises(SandboxNotFoundError):
        await first.connect(descriptor)


async def test_pause_resume(provider: DockerProvider) -> None:
    handle = await provider.create(spec())
    await provider.pause(handle)
    assert await provider.status(handle) == SandboxStatus.PAUSED
    with pytest.raises(SandboxError, match="after resume"):
        await provider.exec(handle, "true")
    await provider.resume(handle)
    assert (await provider.exec(handle, "echo up")).stdout == "up\n"
    await provider.close(handle)


async def test_an_exec_right_after_resume_runs(provider: DockerProvider) -> None:
    """dockerd applies containerd's "paused" event asynchronously: landing after the unpause, it marks the
    container paused again for a moment (a second pause/unpause in its event log). An exec right after
    ``resume()`` runs all the same, every time."""
    handle = await provider.create(spec())
    for _ in range(40):
        await provider.pause(handle)
        await provider.resume(handle)
        assert (await provider.exec(handle, "echo up")).stdout == "up\n"
    await provider.close(handle)


async def test_endpoint_on_loopback_only(make: Callable[..., DockerProvider]) -> None:
    """A declared port is published on 127.0.0.1 alone, and serves."""
    require_bridge()
    cannot_hold("runsc", "runsc is registered with --network=none here (the ptrace platform needs it): no network")
    provider = make(network="bridge")
    handle = await provider.create(spec(PYTHON, ports=[8000], entrypoint=["python3", "-m", "http.server", "8000"]))
    endpoint = await provider.endpoint(handle, 8000)
    assert endpoint.endpoint.startswith("http://127.0.0.1:")
    async with httpx.AsyncClient() as client:
        for _ in range(100):
            try:
                reply = await client.get(endpoint.endpoint)
                break
            except httpx.TransportError:
                import anyio

                await anyio.sleep(0.1)
        assert reply.status_code == 200
    with pytest.raises(SandboxError, match="not declared"):
        await provider.endpoint(handle, 9000)
    await provider.close(handle)


async def test_capabilities_and_pickling(make: Callable[..., DockerProvider]) -> None:
    provider = make(memory_mib=512)
    present = {protocol.__name__ for protocol in CAPABILITIES if isinstance(provider, protocol)}
    assert present == {
        "SupportsSandboxEndpoint",
        "ConnectableProvider",
        "SupportsSandboxPauseResume",
        "SupportsSandboxList",
        "SupportsSandboxSnapshot",
    }
    assert isinstance(provider, SupportsSandboxList | SupportsSandboxPauseResume)
    copy = pickle.loads(pickle.dumps(provider))
    assert isinstance(copy, DockerProvider) and copy._options == provider._options


async def test_a_config_builds_it_by_name(docker: None) -> None:
    options = {"memory_mib": 256, "runtime": RUNTIME}
    provider = build_provider({"provider": {"docker": options}, "middleware": ["metrics"]})
    handle = await provider.create(spec())
    assert (await provider.exec(handle, "echo $((6 * 7))")).stdout == "42\n"
    await provider.close(handle)
    await provider.aclose()
