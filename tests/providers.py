"""Small in-process providers for tests, written against the protocol without inheritance."""

from __future__ import annotations

import inspect
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio

from sandbox_middleware import (
    SandboxEndpoint,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SandboxStatus,
)

from .needs import unavailable

P = TypeVar("P", bound=SandboxProvider)


class PlainProvider:
    """A provider that only knows the protocol; records each call as (operation, sandbox id)."""

    name = "plain"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.alive: set[str] = set()
        self._ids = 0  # an int, not itertools.count: providers pickle (3.14 drops itertools pickling)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        sandbox_id = f"plain-{self._ids}"
        self._ids += 1
        self.calls.append(("create", sandbox_id))
        self.alive.add(sandbox_id)
        return SandboxHandle(sandbox_id, self.name, None)

    async def exec(self, handle: SandboxHandle, command: str, **options: object) -> SandboxExecResult:
        """The protocol's keyword options (cwd, env, timeout_s, user) are accepted and ignored."""
        self.calls.append(("exec", handle.sandbox_id))
        return SandboxExecResult(command, "", 0)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        self.calls.append(("upload", handle.sandbox_id))

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        self.calls.append(("download", handle.sandbox_id))

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        self.calls.append(("status", handle.sandbox_id))
        return SandboxStatus.RUNNING if handle.sandbox_id in self.alive else SandboxStatus.STOPPED

    async def close(self, handle: SandboxHandle) -> None:
        self.calls.append(("close", handle.sandbox_id))
        self.alive.discard(handle.sandbox_id)

    async def aclose(self) -> None:
        self.calls.append(("aclose", ""))


class EndpointProvider(PlainProvider):
    async def endpoint(self, handle: SandboxHandle, port: int) -> SandboxEndpoint:
        self.calls.append(("endpoint", handle.sandbox_id))
        return SandboxEndpoint(f"http://sandbox-{handle.sandbox_id}:{port}")


class ConnectProvider(PlainProvider):
    async def serialize_handle(self, handle: SandboxHandle, *, scope: str | None = None) -> dict[str, Any]:
        self.calls.append(("serialize_handle", handle.sandbox_id))
        return {"sandbox_id": handle.sandbox_id}

    async def connect(self, descriptor: Mapping[str, Any]) -> SandboxHandle:
        self.calls.append(("connect", str(descriptor["sandbox_id"])))
        self.alive.add(str(descriptor["sandbox_id"]))
        return SandboxHandle(str(descriptor["sandbox_id"]), self.name, None)


class PtyProvider(PlainProvider):
    async def create_pty(self, handle: SandboxHandle, spec: Any) -> Any:
        self.calls.append(("create_pty", handle.sandbox_id))
        return ("pty", handle.sandbox_id, spec)


def scripted_provider(*capabilities: type) -> PlainProvider:
    """A ``PlainProvider`` that also implements ``capabilities`` (protocol classes), written from
    their members: each method records ``(name, sandbox id or "")`` and returns ``(name, args, kwargs)``."""

    def scripted(name: str, is_async: bool) -> Callable[..., Any]:
        def record(self: PlainProvider, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self.calls.append((name, args[0].sandbox_id if args and isinstance(args[0], SandboxHandle) else ""))
            return (name, args, kwargs)

        if is_async:

            async def method(self: PlainProvider, *args: Any, **kwargs: Any) -> Any:
                return record(self, args, kwargs)

        else:

            def method(self: PlainProvider, *args: Any, **kwargs: Any) -> Any:
                return record(self, args, kwargs)

        return method

    namespace = {
        name: scripted(name, inspect.iscoroutinefunction(declared))
        for protocol in capabilities
        for name, declared in vars(protocol).items()
        if inspect.isfunction(declared) and not name.startswith("_")
    }
    names = "+".join(protocol.__name__ for protocol in capabilities)
    return type(f"Scripted[{names}]", (PlainProvider,), namespace)()


def recommended_stack(inner: Any, telemetry: Any = None, **retry: Any) -> Any:
    """The recommended stack (``recommended_middleware``) over ``inner``, recording into ``telemetry``
    (a ``TelemetryCapture``) when given; ``retry`` are RetryMiddleware options."""
    from sandbox_middleware import recommended_middleware, stack

    meters = None if telemetry is None else telemetry.meter_provider
    tracers = None if telemetry is None else telemetry.tracer_provider
    return stack(inner, recommended_middleware(meter_provider=meters, tracer_provider=tracers, retry=retry))


async def round_trip(provider: Any, handle: SandboxHandle, tmp_path: Path, directory: str = "") -> None:
    """Upload a file into ``directory`` of the sandbox (its working directory by default), transform it
    there with a command, download the result and check it; the sandbox is still running after."""
    (tmp_path / "in.txt").write_text("payload")
    await provider.upload_file(handle, tmp_path / "in.txt", f"{directory}in.txt")
    result = await provider.exec(
        handle, f"tr a-z A-Z < {directory}in.txt > {directory}out.txt && cat {directory}out.txt"
    )
    assert (result.return_code, result.stdout) == (0, "PAYLOAD")
    await provider.download_file(handle, f"{directory}out.txt", tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "PAYLOAD"
    assert await provider.status(handle) == SandboxStatus.RUNNING


async def crashed_worker(argv: Sequence[str]) -> set[str]:
    """Run a worker that prints the ids of the three sandboxes it creates, one a line, then SIGKILL
    it: its sandboxes are held by nobody. Returns their ids."""
    async with live_worker(argv) as ids:
        return ids


@asynccontextmanager
async def live_worker(argv: Sequence[str]) -> AsyncIterator[set[str]]:
    """Run a worker that prints the ids of the three sandboxes it creates, one a line; yield their ids
    while it lives; SIGKILL it after."""
    async with await anyio.open_process(list(argv)) as worker:
        try:
            assert worker.stdout is not None
            lines = b""
            with anyio.fail_after(60):
                async for chunk in worker.stdout:
                    lines += chunk
                    if lines.count(b"\n") == 3:
                        break
            yield set(lines.decode().split())
        finally:
            worker.send_signal(signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await worker.wait()


PIDNS_REQUIRE = "REQUIRE_PIDNS"


def in_own_pid_namespace(argv: Sequence[str]) -> list[str]:
    """``argv`` as pid 1 of a PID namespace of its own with a /proc of it, the host's hostname and
    network (a trainer in a host-network container); its namespace, and all in it, die with it.
    Skips the test where unshare cannot make one (it needs root)."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    try:
        made = subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        made = False
    if not made:
        unavailable(
            "unshare cannot make a PID namespace here (needs root and util-linux: apt-get install util-linux)",
            PIDNS_REQUIRE,
        )
    return [*command, *argv]


@asynccontextmanager
async def closing_all(provider_class: Callable[..., P]) -> AsyncIterator[Callable[..., P]]:
    """A factory of ``provider_class(**options)`` whose every provider is closed (``aclose``) at the
    end of the block: a fixture's providers, closed after its test, even a failed one."""
    made: list[P] = []

    def build(**options: Any) -> P:
        made.append(provider_class(**options))
        return made[-1]

    yield build
    for provider in made:
        await provider.aclose()


def dead_owner_stamp() -> dict[str, str]:
    """The owner stamp (``Owner.metadata()``) of a process of this host that has exited: a crashed worker's."""
    code = "import json; from sandbox_middleware._owner import Owner; print(json.dumps(Owner.current().metadata()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    stamp: dict[str, str] = json.loads(done.stdout)
    return stamp
