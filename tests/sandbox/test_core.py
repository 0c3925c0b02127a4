"""The middleware core: ordering, delegation and capability transparency."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path
from typing import Any, TypeVar

import pytest
from opentelemetry.sdk.metrics import MeterProvider

import sandbox_middleware
from sandbox_middleware import (
    CAPABILITIES,
    DEFAULT_RETRY_ON,
    SANDBOX_CREATE_ERRORS,
    ConnectableProvider,
    ExecResult,
    MetricsMiddleware,
    Middleware,
    Operation,
    ProviderMiddleware,
    RegistryError,
    ReleaseAccountingMiddleware,
    RetryMiddleware,
    SandboxCreateError,
    SandboxCreateVerificationError,
    SandboxEndpoint,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxPtySession,
    SandboxResources,
    SandboxSpec,
    SandboxStatus,
    SandboxValueError,
    SupportsSandboxEndpoint,
    SupportsSandboxList,
    SupportsSandboxSnapshot,
    TracingMiddleware,
    _protocol,
    stack,
)
from sandbox_middleware._registry import provider_registry
from sandbox_middleware.middleware._retry import RETRYABLE_OPERATIONS
from sandbox_middleware.testing import FaultInjectingProvider
from tests.providers import ConnectProvider, EndpointProvider, PlainProvider, scripted_provider

pytestmark = pytest.mark.anyio

T = TypeVar("T")


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


FIVE_LAYERS = [
    Middleware(ProviderMiddleware),
    Middleware(ObservesConnect),
    Middleware(Recording, label="r", log=[]),
    Middleware(RetryMiddleware, operations=RETRYABLE_OPERATIONS),
    Middleware(TracingMiddleware),
]


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_"]


def _call_args(protocol: type, method: str, handle: SandboxHandle) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments for ``method`` read from its declaration: the handle first, then a value per parameter."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for parameter in list(inspect.signature(vars(protocol)[method]).parameters.values())[1:]:
        value = handle if parameter.name == "handle" else f"<{parameter.name}>"
        if parameter.kind is parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def test_every_capability_protocol_is_in_the_table_once() -> None:
    """The table holds each capability ``_protocol.py`` declares (every runtime-checkable protocol but the
    pty session a capability returns), once: NeMo Gym 0.7.0's ten (their names and signatures checked
    against NeMo Gym by tests/interop/test_capabilities.py) and our listing and snapshot capabilities;
    the package exports each under its name."""
    declared = {value for value in vars(_protocol).values() if getattr(value, "_is_runtime_protocol", False)}
    assert len(CAPABILITIES) == len(set(CAPABILITIES)) == 12
    assert set(CAPABILITIES) == declared - {SandboxPtySession}
    assert {SupportsSandboxList, SupportsSandboxSnapshot} < set(CAPABILITIES)
    for protocol in CAPABILITIES:
        assert protocol.__name__ in sandbox_middleware.__all__
        assert getattr(sandbox_middleware, protocol.__name__) is protocol


@pytest.mark.parametrize("protocol", CAPABILITIES, ids=lambda p: p.__name__)
async def test_capability_present_through_five_layers(protocol: type) -> None:
    """A capability of the innermost provider is visible through five layers, the others are not, and
    every method of it (sync or async) reaches the provider with its arguments and returns its result."""
    inner = scripted_provider(protocol)
    provider = stack(inner, FIVE_LAYERS)
    assert [other for other in CAPABILITIES if isinstance(provider, other)] == [protocol]
    handle = await provider.create(SandboxSpec())
    for method in _methods(protocol):
        args, kwargs = _call_args(protocol, method, handle)
        result = getattr(provider, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        assert result == (method, args, kwargs)
        assert inner.calls[-1][0] == method


@pytest.mark.parametrize("protocol", CAPABILITIES, ids=lambda p: p.__name__)
async def test_capability_absent_through_five_layers(protocol: type) -> None:
    """A capability the innermost provider lacks is absent from every layer, even one overriding it."""
    others = [other for other in CAPABILITIES if other is not protocol]
    for inner in (PlainProvider(), scripted_provider(*others)):
        provider = stack(inner, FIVE_LAYERS)
        layer: Any = provider
        for _ in FIVE_LAYERS:
            assert not isinstance(layer, protocol)
            assert all(getattr(layer, method, None) is None for method in _methods(protocol))
            layer = layer.inner


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


class EndpointConnectProvider(EndpointProvider, ConnectProvider):
    """Two capabilities, and a module-level class, so it pickles."""


class KeywordProvider(PlainProvider):
    """Accepts an extension keyword on every operation, as NeMo Gym's Docker provider does on exec."""

    seen: list[tuple[str, Any]]

    async def create(self, spec: SandboxSpec, *, region: str = "") -> SandboxHandle:
        self.seen = [("create", region)]
        return await super().create(spec)

    async def exec(self, handle: SandboxHandle, command: str, *, stdin: bytes | None = None, **kwargs: Any) -> Any:
        self.seen.append(("exec", stdin))
        return await super().exec(handle, command, **kwargs)

    async def upload_file(self, handle: SandboxHandle, source: Path, target: str, *, mode: int = 0) -> None:
        self.seen.append(("upload", mode))

    async def download_file(self, handle: SandboxHandle, source: str, target: Path, *, follow: bool = False) -> None:
        self.seen.append(("download", follow))

    async def status(self, handle: SandboxHandle, *, fresh: bool = False) -> Any:
        self.seen.append(("status", fresh))
        return await super().status(handle)

    async def close(self, handle: SandboxHandle, *, force: bool = False) -> None:
        self.seen.append(("close", force))
        await super().close(handle)


def _full_stack(inner: SandboxProvider, **retry: Any) -> SandboxProvider:
    return stack(
        inner,
        [
            Middleware(RetryMiddleware, **retry),
            Middleware(MetricsMiddleware),
            Middleware(TracingMiddleware, record_command=True),
            Middleware(ReleaseAccountingMiddleware, release_timeout_s=5.0),
        ],
    )


async def _every_operation_with_extensions(provider: Any, **exec_options: Any) -> None:
    """Every operation, each with a keyword of KeywordProvider's own; ``exec_options`` go to exec too."""
    handle = await provider.create(SandboxSpec(), region="eu")
    await provider.exec(handle, "cat", stdin=b"x", **exec_options)
    await provider.upload_file(handle, Path("a"), "b", mode=0o600)
    await provider.download_file(handle, "b", Path("a"), follow=True)
    await provider.status(handle, fresh=True)
    await provider.close(handle, force=True)


# What KeywordProvider sees of _every_operation_with_extensions.
EXTENSIONS_SEEN = [
    ("create", "eu"),
    ("exec", b"x"),
    ("upload", 0o600),
    ("download", True),
    ("status", True),
    ("close", True),
]


class Seeing(ProviderMiddleware):
    """A one-method layer: notes what each operation looks like in ``around``, then runs it."""

    def __init__(self, inner: SandboxProvider) -> None:
        super().__init__(inner)
        self.seen: list[tuple[Any, ...]] = []

    async def around(self, operation: Operation[T]) -> T:
        handle = operation.handle.sandbox_id if operation.handle is not None else None
        spec = operation.spec is not None
        self.seen.append((operation.name, handle, operation.command, spec, operation.extensions))
        return await operation()


class Twice(ProviderMiddleware):
    """Calls every operation twice and returns the second result, as a retry of one failed attempt would."""

    async def around(self, operation: Operation[T]) -> T:
        await operation()
        return await operation()


async def test_around_sees_all_six_operations() -> None:
    """A layer that only overrides around sees every operation with its name, handle, command and spec;
    each result comes back through it."""
    inner = PlainProvider()
    provider: Any = stack(inner, [Middleware(Seeing), Middleware(ProviderMiddleware)])
    handle = await provider.create(SandboxSpec())
    assert (await provider.exec(handle, "echo hi", cwd="/tmp")).stdout == "echo hi"
    await provider.upload_file(handle, Path("a"), "b")
    await provider.download_file(handle, "b", Path("a"))
    assert await provider.status(handle) == SandboxStatus.RUNNING
    await provider.close(handle)
    await provider.aclose()
    sid = handle.sandbox_id
    assert provider.seen == [
        ("create", None, None, True, {}),
        ("exec", sid, "echo hi", False, {}),
        ("upload", sid, None, False, {}),
        ("download", sid, None, False, {}),
        ("status", sid, None, False, {}),
        ("close", sid, None, False, {}),
    ]
    assert [op for op, _ in inner.calls] == ["create", "exec", "upload", "download", "status", "close", "aclose"]


async def test_around_runs_the_operation_again_each_time_it_is_called() -> None:
    """Calling the operation twice runs it twice on the inner provider (a retry), with the same arguments."""
    inner = KeywordProvider()
    provider: Any = stack(inner, [Middleware(Twice)])
    handle = await provider.create(SandboxSpec(), region="eu")
    result = await provider.exec(handle, "cat", stdin=b"x")
    await provider.close(handle, force=True)
    assert result.stdout == "cat"
    # (KeywordProvider starts its seen list afresh on each create)
    assert inner.seen == [("create", "eu"), ("exec", b"x"), ("exec", b"x"), ("close", True), ("close", True)]
    assert [op for op, _ in inner.calls] == ["create", "create", "exec", "exec", "close", "close"]


async def test_around_passes_extensions_through_unchanged() -> None:
    """Keywords a provider adds reach it through a one-method layer, and the layer sees them."""
    inner = KeywordProvider()
    seeing = Seeing(inner)
    await _every_operation_with_extensions(seeing, timeout_s=5)
    assert inner.seen == EXTENSIONS_SEEN
    assert [extensions for *_, extensions in seeing.seen] == [
        {"region": "eu"},
        {"stdin": b"x"},  # the protocol's own options (timeout_s=5) are not extensions
        {"mode": 0o600},
        {"follow": True},
        {"fresh": True},
        {"force": True},
    ]


class Quiet(ProviderMiddleware):
    """A layer that overrides nothing but its constructor."""

    def __init__(self, inner: SandboxProvider, *, label: str = "") -> None:
        super().__init__(inner)
        self.label = label


async def _every_operation(provider: Any) -> None:
    handle = await provider.create(SandboxSpec())
    await provider.exec(handle, "true")
    await provider.upload_file(handle, Path("a"), "b")
    await provider.download_file(handle, "b", Path("a"))
    await provider.status(handle)
    await provider.close(handle)


async def test_layers_that_wrap_nothing_build_no_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that does not override around is a pure pass-through, and so are the built-in layers on
    what they do not wrap right now: Tracing and Metrics without an SDK, Retry outside its operations.
    None of them makes an Operation; a layer that overrides around gets one per operation."""
    made: list[str] = []

    class Counted(Operation[Any]):
        __slots__ = ()

        def __init__(self, name: str, *args: Any) -> None:
            made.append(name)
            super().__init__(name, *args)

    monkeypatch.setattr(sandbox_middleware._core, "Operation", Counted)
    inner = PlainProvider()
    provider = stack(
        inner,
        [
            Middleware(Quiet, label="q"),
            Middleware(ProviderMiddleware),
            Middleware(TracingMiddleware),  # the global API provider: no SDK in tests
            Middleware(MetricsMiddleware),
            Middleware(ReleaseAccountingMiddleware),
            Middleware(RetryMiddleware, operations=("close",)),
        ],
    )
    await _every_operation(provider)
    assert made == ["close"]  # Retry's, on the one operation it retries
    assert [op for op, _ in inner.calls] == ["create", "exec", "upload", "download", "status", "close"]
    made.clear()
    await _every_operation(Seeing(PlainProvider()))
    assert made == ["create", "exec", "upload", "download", "status", "close"]


def test_the_built_in_layers_wrap_only_around() -> None:
    """Retry, Metrics, Tracing and the fault injector implement around and none of the six operations:
    their exec is the base class's, with its true signature."""
    operations = ("create", "exec", "upload_file", "download_file", "status", "close")
    for cls in (RetryMiddleware, MetricsMiddleware, TracingMiddleware, FaultInjectingProvider):
        assert "around" in vars(cls)
        assert [name for name in operations if name in vars(cls)] == []
    signature = inspect.signature(TracingMiddleware(PlainProvider()).exec)
    assert list(signature.parameters) == ["handle", "command", "cwd", "env", "timeout_s", "user", "extensions"]


async def test_a_one_method_layer_pickles_and_keeps_wrapping() -> None:
    """A user's around layer round-trips through pickle with its capabilities and still sees every call."""
    layer: Any = pickle.loads(pickle.dumps(Seeing(EndpointProvider())))
    assert isinstance(layer, Seeing) and isinstance(layer, SupportsSandboxEndpoint)
    handle = await layer.create(SandboxSpec())
    await layer.exec(handle, "true")
    assert [name for name, *_ in layer.seen] == ["create", "exec"]


async def test_extension_keywords_reach_the_provider_through_every_layer(telemetry: Any) -> None:
    """Keywords a provider adds to an operation pass every layer unchanged, with telemetry on and
    every operation retried (so each goes through the retry path too)."""
    inner = KeywordProvider()
    provider: Any = stack(
        inner,
        [
            Middleware(RetryMiddleware, operations=RETRYABLE_OPERATIONS),
            Middleware(MetricsMiddleware, meter_provider=telemetry.meter_provider),
            Middleware(TracingMiddleware, tracer_provider=telemetry.tracer_provider),
            Middleware(ReleaseAccountingMiddleware, meter_provider=telemetry.meter_provider),
            Middleware(ProviderMiddleware),
        ],
    )
    await _every_operation_with_extensions(provider)
    assert inner.seen == EXTENSIONS_SEEN
    assert telemetry.histogram_count("gym.sandbox.exec_duration_ms") == 1


async def test_a_pickled_stack_behaves_like_the_original() -> None:
    """A stack round-trips through pickle and copy with its options, capabilities and calls."""
    original: Any = _full_stack(EndpointConnectProvider(), attempts=3, operations=("create", "status"))
    for restored in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original), copy.copy(original)):
        assert type(restored) is type(original)
        assert restored.attempts == 3 and restored.operations == {"create", "status"}
        assert restored.inner.inner.record_command is True
        assert restored.inner.inner.inner.release_timeout_s == 5.0
        assert [p for p in CAPABILITIES if isinstance(restored, p)] == [SupportsSandboxEndpoint, ConnectableProvider]
        handle = await restored.create(SandboxSpec())
        assert (await restored.endpoint(handle, 8080)).endpoint.endswith(":8080")
        assert (await restored.serialize_handle(handle)) == {"sandbox_id": handle.sandbox_id}
        await restored.close(handle)
        inner = restored.inner.inner.inner.inner
        assert [op for op, _ in inner.calls][-4:] == ["create", "endpoint", "serialize_handle", "close"]
    assert [op for op, _ in original.inner.inner.inner.inner.calls] == (
        # copy.copy shares the inner provider; pickle and deepcopy do not
        ["create", "endpoint", "serialize_handle", "close"]
    )
    plain: Any = pickle.loads(pickle.dumps(_full_stack(PlainProvider())))
    assert not any(isinstance(plain, p) for p in CAPABILITIES)


def test_signatures_are_the_written_ones() -> None:
    """inspect.signature shows a layer's real options, also for a subclass without its own __init__."""

    class Quiet(RetryMiddleware):
        pass

    assert list(inspect.signature(ProviderMiddleware).parameters) == ["inner"]
    assert "attempts" in inspect.signature(Quiet).parameters
    layer = Quiet(EndpointProvider(), attempts=2)
    assert isinstance(layer, Quiet) and type(layer).__name__ == "Quiet"
    assert inspect.signature(type(layer)) == inspect.signature(RetryMiddleware)
    assert list(inspect.signature(layer.endpoint).parameters) == ["handle", "port"]


def test_a_layer_with_its_own_telemetry_provider_refuses_to_pickle_clearly() -> None:
    """An explicit SDK provider belongs to one process: pickling says so instead of a lock error."""
    meter_provider = MeterProvider()
    try:
        layer = MetricsMiddleware(PlainProvider(), meter_provider=meter_provider)
        with pytest.raises(TypeError, match="explicit meter_provider"):
            pickle.dumps(layer)
    finally:
        meter_provider.shutdown()


def test_default_spec_has_resources_and_mappings_are_converted() -> None:
    """The default spec carries an empty SandboxResources (NeMo Gym providers read spec.resources.cpu);
    a mapping becomes one, ports become a tuple of ints."""
    assert SandboxSpec().resources == SandboxResources()
    assert SandboxSpec().resources.cpu is None  # type: ignore[union-attr]
    spec = SandboxSpec(resources={"cpu": "2", "memory_mib": 512.0}, ports=["8080", 9000])
    assert spec.resources == SandboxResources(cpu=2.0, memory_mib=512)
    assert spec.ports == (8080, 9000)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SandboxSpec(resources={"cpus": 2}), "Unknown sandbox resource keys: cpus"),
        (lambda: SandboxSpec(resources={"cpu": "two"}), "'cpu' must be a float"),
        (lambda: SandboxSpec(resources=[("cpu", 1)]), "must be a SandboxResources or a mapping"),
        (lambda: SandboxSpec(ports=8080), "list or tuple"),
        (lambda: SandboxSpec(ports=[True]), "Invalid sandbox TCP port: True"),
        (lambda: SandboxSpec(ports=["http"]), "Invalid sandbox TCP port: 'http'"),
        (lambda: SandboxSpec(ports=[0]), "between 1 and 65535, got 0"),
        (lambda: SandboxSpec(ports=[80, "80"]), "Duplicate sandbox TCP port: 80"),
        (lambda: SandboxSpec(files={"a.txt": Path("/etc/hosts")}), "local_files="),
        (lambda: SandboxEndpoint("localhost:8080"), "absolute URL"),
        (lambda: SandboxEndpoint(" "), "absolute URL"),
        (lambda: SandboxEndpoint("http://h", headers=[("a", "b")]), "headers must be a mapping"),
    ],
)
def test_values_nemo_gym_refuses_are_typed_errors(build: Any, message: str) -> None:
    """What NeMo Gym refuses is refused here too, as a SandboxValueError (also a ValueError and a
    TypeError, the classes NeMo Gym raises), with a message naming the value."""
    with pytest.raises(SandboxValueError, match=message) as caught:
        build()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


def test_endpoint_is_normalised_and_create_errors_are_one_family() -> None:
    """An endpoint is stripped and its headers become strings; create failures of this package are in
    SANDBOX_CREATE_ERRORS and RetryMiddleware's default covers them."""
    endpoint = SandboxEndpoint(" http://127.0.0.1:8080 ", headers={"n": 1})  # type: ignore[dict-item]
    assert endpoint == SandboxEndpoint("http://127.0.0.1:8080", {"n": "1"})
    assert SandboxCreateError in SANDBOX_CREATE_ERRORS
    assert issubclass(SandboxCreateVerificationError, SandboxCreateError)
    assert set(SANDBOX_CREATE_ERRORS) <= set(DEFAULT_RETRY_ON) and ConnectionError in DEFAULT_RETRY_ON
    assert SandboxStatus.PAUSED == "paused" and ExecResult is SandboxExecResult


@pytest.mark.skipif(sandbox_middleware._protocol.NEMO_GYM is not None, reason="NeMo Gym is installed here")
def test_a_nemo_gym_provider_name_without_nemo_gym_says_what_to_install() -> None:
    """``nemo_gym.NAME`` names NeMo Gym's registry; without NeMo Gym the error says so."""
    with pytest.raises(RegistryError, match="comes from NeMo Gym, which is not installed here; install nemo-gym"):
        provider_registry.get("nemo_gym.local")
    assert not [name for name in provider_registry.names() if name.startswith("nemo_gym.")]


async def test_pass_through_layers_add_no_coroutine_of_their_own() -> None:
    """A layer with nothing to do for an operation hands back the inner provider's own awaitable: no
    frame per layer for the collector to track while thousands of calls are in flight."""
    inner = PlainProvider()
    layers = stack(
        inner, [Middleware(ProviderMiddleware), Middleware(ReleaseAccountingMiddleware), Middleware(RetryMiddleware)]
    )
    handle = await layers.create(SandboxSpec())
    call = layers.exec(handle, "true")
    assert call.cr_code is PlainProvider.exec.__code__  # type: ignore[attr-defined]
    assert (await call).return_code == 0
    closing = layers.close(handle)
    assert closing.cr_code is not PlainProvider.close.__code__  # type: ignore[attr-defined]  # the ledger's
    await closing
