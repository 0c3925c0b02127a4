"""The middleware core: ordering, delegation and capability transparency."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox_middleware import (
    ConnectableProvider,
    Middleware,
    ProviderMiddleware,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SupportsSandboxEndpoint,
    SupportsSandboxPty,
    stack,
)

from .providers import ConnectProvider, EndpointProvider, PlainProvider, PtyProvider

pytestmark = pytest.mark.anyio


class Recording(ProviderMiddleware):
    """Appends ``>label`` on the way in and ``<label`` on the way out of every exec."""

    def __init__(self, inner: SandboxProvider, *, label: str, log: list[str]) -> None:
        super().__init__(inner)
        self.label = label
        self.log = log

    async def exec(self, handle: SandboxHandle, command: str, **kwargs: Any) -> SandboxExecResult:
        self.log.append(f">{self.label}")
        result = await super().exec(handle, command, **kwargs)
        self.log.append(f"<{self.label}")
        return result


class ObservesConnect(ProviderMiddleware):
    """Overrides connect: it must still claim the capability only when the inner provider has it."""

    connected = 0

    async def connect(self, descriptor: Any) -> SandboxHandle:
        ObservesConnect.connected += 1
        handle: SandboxHandle = await self.inner.connect(descriptor)  # type: ignore[attr-defined]
        return handle


async def test_first_entry_is_outermost() -> None:
    """The first middleware sees the call first and the result last."""
    log: list[str] = []
    provider = stack(
        PlainProvider(),
        [
            Middleware(Recording, label="a", log=log),
            Middleware(Recording, label="b", log=log),
            Middleware(Recording, label="c", log=log),
        ],
    )
    handle = await provider.create(SandboxSpec())
    result = await provider.exec(handle, "echo hi")
    assert result.stdout == "echo hi"
    assert log == [">a", ">b", ">c", "<c", "<b", "<a"]
    assert isinstance(provider, Recording) and provider.label == "a"


async def test_plain_protocol_class_passes_through_a_stack() -> None:
    """A class written against the protocol without inheritance is wrapped and every call reaches it."""
    plain = PlainProvider()
    provider = stack(plain, [Middleware(ProviderMiddleware), Middleware(ProviderMiddleware)])
    assert provider.name == "plain"
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "true")
    await provider.upload_file(handle, __import__("pathlib").Path("x"), "y")
    await provider.download_file(handle, "y", __import__("pathlib").Path("x"))
    await provider.status(handle)
    await provider.close(handle)
    await provider.aclose()
    assert [op for op, _ in plain.calls] == ["create", "exec", "upload", "download", "status", "close", "aclose"]


CAPABILITIES = [
    (SupportsSandboxEndpoint, EndpointProvider, "endpoint", (8080,)),
    (ConnectableProvider, ConnectProvider, "serialize_handle", ()),
    (SupportsSandboxPty, PtyProvider, "create_pty", ({"cols": 80},)),
]


@pytest.mark.parametrize(("protocol", "provider_cls", "method", "args"), CAPABILITIES)
async def test_capability_present_through_three_layers(
    protocol: type, provider_cls: type[PlainProvider], method: str, args: tuple[Any, ...]
) -> None:
    """A capability of the innermost provider is visible and reached through three layers."""
    inner = provider_cls()
    provider = stack(
        inner, [Middleware(ProviderMiddleware), Middleware(ObservesConnect), Middleware(Recording, label="r", log=[])]
    )
    assert isinstance(provider, protocol)
    handle = await provider.create(SandboxSpec())
    await getattr(provider, method)(handle, *args)
    assert inner.calls[-1] == (method, handle.sandbox_id)


@pytest.mark.parametrize(("protocol", "provider_cls", "method", "args"), CAPABILITIES)
async def test_capability_absent_through_three_layers(
    protocol: type, provider_cls: type[PlainProvider], method: str, args: tuple[Any, ...]
) -> None:
    """A capability the innermost provider lacks is absent from every layer, even one overriding it."""
    others = [cls for _, cls, _, _ in CAPABILITIES if cls is not provider_cls]
    for inner in (PlainProvider(), *(cls() for cls in others)):
        provider = stack(
            inner,
            [Middleware(ProviderMiddleware), Middleware(ObservesConnect), Middleware(Recording, label="r", log=[])],
        )
        assert not isinstance(provider, protocol)
        assert getattr(provider, method, None) is None


async def test_connect_reaches_inner_and_override_runs() -> None:
    """An override of a capability method runs and the call reaches the provider."""
    inner = ConnectProvider()
    provider = stack(inner, [Middleware(ObservesConnect), Middleware(ProviderMiddleware)])
    assert isinstance(provider, ConnectableProvider)
    before = ObservesConnect.connected
    handle = await provider.connect({"sandbox_id": "abc"})
    assert handle.sandbox_id == "abc"
    assert ObservesConnect.connected == before + 1
    assert inner.calls[-1] == ("connect", "abc")


def test_middleware_repr_and_name() -> None:
    """Middleware reads like the call it defers; a layer takes its provider's name."""
    entry = Middleware(Recording, label="x", log=[])
    assert repr(entry) == "Middleware(Recording, label='x', log=[])"
    assert entry.build(PlainProvider()).name == "plain"
    layer = ProviderMiddleware(PlainProvider())
    assert type(layer) is ProviderMiddleware
    assert repr(layer).startswith("ProviderMiddleware(")
