"""OpenTelemetry for ``sandbox_middleware`` and ``tokens``: lazy providers and calls that never raise.

Shared by both packages (neither imports the other's private modules). Only the OpenTelemetry API
is used. With no SDK configured (the API's proxy or no-op providers) nothing is created or
recorded; once an SDK provider is installed, globally or passed in, the instruments are created
once per meter and reused by every instance. A telemetry call that raises (a broken exporter, a
span processor that throws) is logged once and never reaches the caller.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, Self, TypeVar

from opentelemetry import context, metrics, trace
from opentelemetry.environment_variables import OTEL_PYTHON_METER_PROVIDER, OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.metrics import Meter, MeterProvider, NoOpMeterProvider
from opentelemetry.trace import Span, StatusCode, Tracer, TracerProvider

__all__ = [
    "DURATION_BUCKETS_MS",
    "ERROR_TYPE_ATTR",
    "SCOPE",
    "InstrumentBundle",
    "Instruments",
    "Tracing",
    "counter",
    "duration_ms",
    "error_type",
    "global_gate",
    "guarded_span",
    "record_error",
    "report_once",
    "safely",
    "up_down_counter",
]

try:  # The API's placeholder before an SDK is installed; private, so its absence only costs speed.
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    _NO_SDK_METER_PROVIDERS: tuple[type, ...] = (NoOpMeterProvider, _ProxyMeterProvider)
except ImportError:  # pragma: no cover
    _NO_SDK_METER_PROVIDERS = (NoOpMeterProvider,)
_NO_SDK_TRACER_PROVIDERS = (trace.NoOpTracerProvider, trace.ProxyTracerProvider)


def _public_tracer_provider() -> TracerProvider | None:
    provider = trace.get_tracer_provider()
    return None if isinstance(provider, _NO_SDK_TRACER_PROVIDERS) else provider


def _public_meter_provider() -> MeterProvider | None:
    provider = metrics.get_meter_provider()
    return None if isinstance(provider, _NO_SDK_METER_PROVIDERS) else provider


# Every operation asks "is an SDK installed yet?" The public getters answer by looking up an
# environment variable on each call (hundreds of nanoseconds); the API modules' own globals answer
# the same question for free. Read them where they exist and no provider is named in the environment.
_trace_globals: Any = trace
_metrics_globals: Any = sys.modules.get("opentelemetry.metrics._internal")
_FAST_TRACE = hasattr(_trace_globals, "_TRACER_PROVIDER") and OTEL_PYTHON_TRACER_PROVIDER not in os.environ
_FAST_METRICS = hasattr(_metrics_globals, "_METER_PROVIDER") and OTEL_PYTHON_METER_PROVIDER not in os.environ

logger = logging.getLogger("sandbox_middleware.telemetry")

SCOPE = "sandbox_middleware"
"""The default instrumentation scope (``tokens`` passes its own)."""
ERROR_TYPE_ATTR = "error.type"

# Finer buckets for HTTP durations (the token client); the SDK's default buckets end at 10 s.
DURATION_BUCKETS_MS: tuple[float, ...] = (
    1, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
    120_000, 300_000, 600_000, 1_200_000, 1_800_000,
)  # fmt: skip

B = TypeVar("B")
G = TypeVar("G")
P = TypeVar("P")

_reported: set[str] = set()
_instrument_cache: weakref.WeakKeyDictionary[Meter, dict[Callable[[Meter], Any], Any]] = weakref.WeakKeyDictionary()


def report_once(what: str, exc: BaseException) -> None:
    """Log a telemetry failure the first time ``what`` fails; the caller's operation goes on."""
    if what not in _reported:
        _reported.add(what)
        logger.warning("telemetry failure in %s, ignored (logged once): %r", what, exc, exc_info=exc)


def safely(what: str, fn: Callable[..., object], *args: Any) -> None:
    """Call a telemetry function; if it raises, report it once under ``what`` and go on."""
    try:
        fn(*args)
    except Exception as exc:
        report_once(what, exc)


def record_error(span: Span, exc: Exception) -> None:
    """Mark ``span`` failed by ``exc``: error status, the exception recorded, ``error.type`` set."""
    span.set_attribute(ERROR_TYPE_ATTR, error_type(exc))
    span.record_exception(exc)
    span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")


def error_type(exc: BaseException) -> str:
    """The exception's qualified class name (``module.Class``; builtins unprefixed)."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _portable(provider: P, option: str) -> P:
    """``provider`` if it may travel to another process (None: the global one there), else a TypeError."""
    if provider is not None:
        raise TypeError(
            f"cannot pickle a layer built with an explicit {option}: OpenTelemetry providers belong to one "
            f"process. Build the layer without {option} (the receiving process's global provider is used), "
            "or build the stack in the receiving process from its configuration"
        )
    return provider


class _GlobalGate:
    """``get()`` is the API's global tracer or meter provider, None until one is set: a single C-level
    call, for the check every operation of a telemetry layer makes while no SDK is installed."""

    __slots__ = ("_kind", "get")

    def __init__(self, kind: str) -> None:
        self._kind = kind
        module = _trace_globals if kind == "trace" else _metrics_globals
        self.get: Callable[[], object] = functools.partial(
            getattr, module, "_TRACER_PROVIDER" if kind == "trace" else "_METER_PROVIDER", None
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._kind,))


def global_gate(kind: str, provider: object, fallback: G) -> _GlobalGate | G:
    """The gate of a layer with ``provider`` (``kind`` "trace" or "metrics"): the global provider's
    cheap check when ``provider`` is None and the API's globals can be read, ``fallback`` otherwise.

    It opens (not None) once any global provider is set; the layer then asks ``fallback``, which
    tells an SDK from a no-op one."""
    fast = _FAST_TRACE if kind == "trace" else _FAST_METRICS
    return _GlobalGate(kind) if provider is None and fast else fallback


@dataclasses.dataclass(frozen=True)
class Instrument:
    """One instrument's declaration: its kind, name, unit and description (and a histogram's buckets).

    ``create(meter)`` makes it; equal declarations are one factory (``Instruments`` caches per meter).
    """

    kind: str  # "counter", "up_down_counter" or "histogram"
    name: str
    unit: str
    description: str
    buckets: tuple[float, ...] = ()

    def create(self, meter: Meter) -> Any:
        if self.kind == "histogram":
            return meter.create_histogram(
                self.name,
                unit=self.unit,
                description=self.description,
                explicit_bucket_boundaries_advisory=list(self.buckets),
            )
        make = meter.create_counter if self.kind == "counter" else meter.create_up_down_counter
        return make(self.name, unit=self.unit, description=self.description)


# Typed Any: each declares the field of an ``InstrumentBundle`` typed as the instrument it makes.
def counter(name: str, unit: str, description: str) -> Any:
    return Instrument("counter", name, unit, description)


def up_down_counter(name: str, unit: str, description: str) -> Any:
    return Instrument("up_down_counter", name, unit, description)


def duration_ms(name: str, description: str, buckets: tuple[float, ...] = DURATION_BUCKETS_MS) -> Any:
    """A histogram of durations in milliseconds (default buckets: ``DURATION_BUCKETS_MS``)."""
    return Instrument("histogram", name, "ms", description, buckets)


class InstrumentBundle:
    """The base of a class of instruments, each attribute declared by its value (``counter``,
    ``up_down_counter``, ``duration_ms``): ``create(meter)`` is an instance holding them all made,
    the factory ``Instruments`` takes."""

    @classmethod
    def create(cls, meter: Meter) -> Self:
        bundle = cls()
        for name, declared in vars(cls).items():
            if isinstance(declared, Instrument):
                setattr(bundle, name, declared.create(meter))
        return bundle


T = TypeVar("T")


class _FromSDK(abc.ABC, Generic[T]):
    """The base of ``Instruments`` and ``Tracing``: ``get()`` is what ``_make`` makes from the SDK
    provider (the one given, else the global one), made once and kept. None while that provider is
    no SDK's (none, a no-op, the API's placeholder) or when making it failed (reported once)."""

    __slots__ = ("_made", "_provider", "_scope")
    _NO_SDK: tuple[type, ...]

    def __init__(self, provider: Any, scope: str) -> None:
        self._provider = provider
        self._scope = scope
        self._made: T | None = None

    @staticmethod
    @abc.abstractmethod
    def _global_provider() -> Any:
        """The global provider, None while none is set."""

    @abc.abstractmethod
    def _make(self, provider: Any) -> T:
        """What ``get()`` returns, from the SDK ``provider``."""

    @abc.abstractmethod
    def _what(self) -> str:
        """What making it is, for the report of its failure."""

    def get(self) -> T | None:
        made = self._made
        if made is not None:
            return made
        provider = self._provider
        if provider is None:
            provider = self._global_provider()
            if provider is None:
                return None
        if isinstance(provider, self._NO_SDK):
            return None
        try:
            made = self._make(provider)
        except Exception as exc:
            report_once(self._what(), exc)
            return None
        self._made = made
        return made


class Instruments(_FromSDK[B]):
    """A middleware's instruments from ``meter_provider`` (default: the global one), or None.

    ``factory`` builds the instrument bundle from a meter; it runs once per meter, whichever
    middleware instance asks first. Returns None while no SDK is configured.
    """

    __slots__ = ("_factory",)
    _NO_SDK = _NO_SDK_METER_PROVIDERS

    def __init__(self, factory: Callable[[Meter], B], meter_provider: MeterProvider | None, scope: str = SCOPE) -> None:
        super().__init__(meter_provider, scope)
        self._factory = factory

    def __reduce__(self) -> tuple[Any, ...]:
        # Instruments belong to this process: the receiving one creates its own from the provider.
        return (type(self), (self._factory, _portable(self._provider, "meter_provider"), self._scope))

    @staticmethod
    def _global_provider() -> MeterProvider | None:
        return _metrics_globals._METER_PROVIDER if _FAST_METRICS else _public_meter_provider()

    def _make(self, provider: MeterProvider) -> B:
        meter = provider.get_meter(self._scope)
        per_meter = _instrument_cache.setdefault(meter, {})
        bundle: B | None = per_meter.get(self._factory)
        if bundle is None:
            bundle = per_meter[self._factory] = self._factory(meter)
        return bundle

    def _what(self) -> str:
        return f"creating instruments ({getattr(self._factory, '__qualname__', self._factory)})"


class Tracing(_FromSDK[Tracer]):
    """The tracer from ``tracer_provider`` (default: the global one), or None without an SDK."""

    __slots__ = ()
    _NO_SDK = _NO_SDK_TRACER_PROVIDERS

    def __init__(self, tracer_provider: TracerProvider | None, scope: str = SCOPE) -> None:
        super().__init__(tracer_provider, scope)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (_portable(self._provider, "tracer_provider"), self._scope))

    @staticmethod
    def _global_provider() -> TracerProvider | None:
        return _trace_globals._TRACER_PROVIDER if _FAST_TRACE else _public_tracer_provider()

    def _make(self, provider: TracerProvider) -> Tracer:
        return provider.get_tracer(self._scope)

    def _what(self) -> str:
        return "creating the tracer"


@contextmanager
def guarded_span(tracer: Tracer, name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span | None]:
    """A span current for the block, with every SDK call guarded: the block always runs and its
    result or exception is never changed by telemetry.

    Yields None when the span could not be started (a span processor raising in ``on_start``). An
    exception from the block marks the span failed (``record_error``) and propagates; ending the
    span (a processor raising in ``on_end``) is reported once, never raised.
    """
    span: Span | None = None
    token: object = None
    try:
        span = tracer.start_span(name, attributes=attributes)
        token = context.attach(trace.set_span_in_context(span))
    except Exception as exc:
        report_once(f"starting span {name}", exc)
    if span is None:
        yield None
        return
    try:
        yield span
    except Exception as exc:
        safely(f"span {name}", record_error, span, exc)
        raise
    finally:
        try:
            if token is not None:
                context.detach(token)  # type: ignore[arg-type]
            span.end()
        except Exception as exc:
            report_once(f"span {name}", exc)
