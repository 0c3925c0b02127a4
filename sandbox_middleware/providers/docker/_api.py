"""The Docker Engine HTTP API over its UNIX socket (httpx), with the API version negotiated once.

Every call goes through ``EngineAPI.call``: a reply of 400 or more becomes ``EngineError`` (its
status and the daemon's own message), and a daemon that cannot be reached becomes
``DockerUnavailableError`` naming the socket. Nothing here knows what a sandbox is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx

from ..._errors import DockerUnavailableError, SandboxError

__all__ = ["MAX_API_VERSION", "MIN_API_VERSION", "EngineAPI", "EngineError", "message_of", "negotiate"]

MIN_API_VERSION = "1.40"  # Docker 19.03: every field the provider sends (Init, Mounts' VolumeOptions, PidsLimit)
MAX_API_VERSION = "1.43"  # the newest whose container and exec bodies the provider was written against
_BASE = "http://docker"  # the host part is unused over a UNIX socket


class EngineError(SandboxError):
    """An Engine API reply of 400 or more: a ``SandboxError`` naming the operation and the daemon's
    answer. Where a reply means something of its own (no such image, a sandbox removed, a path that
    is a symlink) the provider raises the public class that says so instead."""

    def __init__(self, status: int, message: str, what: str) -> None:
        super().__init__(f"{what}: the Docker daemon answered {status}: {message}")
        self.status = status
        self.message = message


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        raise DockerUnavailableError(f"Docker API version {text!r} is not of the form MAJOR.MINOR") from None


def negotiate(socket: str, api_version: str | None, timeout_s: float) -> tuple[str, dict[str, Any]]:
    """The API version to speak with the daemon at ``socket`` (``api_version`` if the daemon accepts
    it, else the older of the daemon's newest and ours, ``MAX_API_VERSION``) and the daemon's
    ``/info`` (what it can enforce). Blocking: construction only."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket), base_url=_BASE, timeout=timeout_s) as client:
            reply = client.get("/version")
            daemon = client.get("/info").json() if reply.status_code == 200 else {}
    except httpx.HTTPError as exc:
        raise DockerUnavailableError(
            f"DockerProvider: no Docker daemon answers at {socket} ({type(exc).__name__}: {exc}); start dockerd "
            "(apt-get install docker.io), or pass socket= (Podman: its Docker-compatible socket)"
        ) from exc
    if reply.status_code != 200:
        raise DockerUnavailableError(
            f"DockerProvider: GET /version at {socket} answered {reply.status_code}, not 200: is it a Docker Engine "
            "API socket? Pass socket= the daemon's (Podman: its Docker-compatible socket)"
        )
    info = reply.json()
    server, oldest = str(info.get("ApiVersion", "")), str(info.get("MinAPIVersion", MIN_API_VERSION))
    if api_version is not None:
        if not _version(oldest) <= _version(api_version) <= _version(server):
            raise DockerUnavailableError(
                f"DockerProvider: api_version {api_version!r} is outside what the daemon at {socket} speaks "
                f"({oldest} to {server}); leave api_version unset to negotiate"
            )
        chosen = api_version
    else:
        chosen = min(server, MAX_API_VERSION, key=_version)
    if _version(chosen) < _version(MIN_API_VERSION):
        raise DockerUnavailableError(
            f"DockerProvider: the daemon at {socket} speaks API {server} at most; this provider needs "
            f"{MIN_API_VERSION} or newer (Docker 19.03+)"
        )
    return chosen, daemon if isinstance(daemon, dict) else {}


class EngineAPI:
    """One connection pool to the daemon, every path prefixed with ``/v<version>``."""

    def __init__(self, socket: str, version: str, timeout_s: float) -> None:
        self.socket = socket
        # An exec's output stream may be silent for as long as its command runs: no read timeout
        # there (the command's own timeout and the sandbox's TTL bound it), the others as usual.
        self._silent_read = httpx.Timeout(timeout_s, read=None)
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket),
            base_url=f"{_BASE}/v{version}",
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        params: Mapping[str, str | list[str]] | None = None,
        body: Any = None,
        content: bytes | AsyncIterator[bytes] | None = None,
        ok: tuple[int, ...] = (),
    ) -> httpx.Response:
        """One request; a status >= 400 not in ``ok`` is ``EngineError``, no daemon ``DockerUnavailableError``."""
        headers = {"Content-Type": "application/x-tar"} if content is not None else None
        try:
            reply = await self._client.request(method, path, params=params, json=body, content=content, headers=headers)
        except httpx.HTTPError as exc:
            raise self.unavailable(what, exc) from exc
        if reply.status_code >= 400 and reply.status_code not in ok:
            raise EngineError(reply.status_code, message_of(reply), what)
        return reply

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        what: str,
        *,
        params: Mapping[str, str | list[str]] | None = None,
        body: Any = None,
        silent_ok: bool = False,
    ) -> AsyncIterator[httpx.Response]:
        """A request whose body is read as it arrives (exec output, archives), as sent: never decompressed.
        ``silent_ok``: the body may pause for any time (a command's output), no read timeout."""
        headers = {"Accept-Encoding": "identity"}
        timeout = self._silent_read if silent_ok else httpx.USE_CLIENT_DEFAULT
        try:
            async with self._client.stream(
                method, path, params=params, json=body, headers=headers, timeout=timeout
            ) as reply:
                if reply.status_code >= 400:
                    await reply.aread()
                    raise EngineError(reply.status_code, message_of(reply), what)
                yield reply
        except httpx.HTTPError as exc:
            raise self.unavailable(what, exc) from exc

    async def inspect(self, container: str, what: str) -> dict[str, Any] | None:
        """The container's ``/json`` description; None where it is gone (404; Podman's 500 "no such container"
        for one another client is removing at that moment)."""
        try:
            reply = await self.call("GET", f"/containers/{container}/json", what, ok=(404,))
        except EngineError as exc:
            if exc.status == 500 and "no such container" in exc.message:
                return None
            raise
        return None if reply.status_code == 404 else dict(reply.json())

    def unavailable(self, what: str, exc: Exception) -> DockerUnavailableError:
        return DockerUnavailableError(
            f"{what}: the Docker daemon at {self.socket} did not answer ({type(exc).__name__}: {exc})"
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def message_of(reply: httpx.Response) -> str:
    """The daemon's own message of an error reply (its JSON ``message``), else the start of its body."""
    try:
        return str(json.loads(reply.content).get("message", "")).strip() or reply.reason_phrase
    except (ValueError, AttributeError):
        return reply.text[:500] or reply.reason_phrase
