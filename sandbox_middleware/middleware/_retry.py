"""``RetryMiddleware``: bounded, attributed, budgeted retries on stamina; ``RetryBudget``: gRPC-style retry
throttling shared by every call through one retry layer."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Collection
from typing import ClassVar, TypeAlias, TypeVar

import anyio
import stamina
from opentelemetry import trace
from opentelemetry.metrics import Counter, MeterProvider

from .._bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds
from .._core import OPERATIONS, Operation, ProviderMiddleware
from .._errors import SANDBOX_CREATE_ERRORS, SandboxArgumentError
from .._protocol import SandboxProvider
from .._telemetry import (
    OPERATION_ATTR,
    PROVIDER_ATTR,
    InstrumentBundle,
    Instruments,
    counter,
    error_type,
    report_once,
)

__all__ = ["DEFAULT_RETRY_ON", "RETRYABLE_OPERATIONS", "RetryBudget", "RetryMiddleware", "RetryOn"]

T = TypeVar("T")

logger = logging.getLogger("sandbox_middleware.retry")

RetryOn: TypeAlias = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool | float | dt.timedelta]
RETRYABLE_OPERATIONS = OPERATIONS
DEFAULT_RETRY_ON: tuple[type[Exception], ...] = (*SANDBOX_CREATE_ERRORS, ConnectionError)
"""Create failures of this package and of NeMo Gym (its providers' ``SandboxCreateError``), and connection errors."""


class RetryBudget:
    """A token bucket that stops retries while a provider keeps failing.

    Each retryable failure spends one token, each success earns ``token_ratio`` back (capped at
    ``max_tokens``), and a retry is allowed only while more than half of ``max_tokens`` remain,
    as in gRPC's retry throttling. Under a sustained outage at most about ``max_tokens / 2``
    retries happen in all, however many callers there are; retries resume once enough successes
    have refilled the bucket.
    """

    __slots__ = ("_tokens", "max_tokens", "token_ratio")
    BOUNDS: ClassVar[Bounds] = Bounds("RetryBudget", max_tokens=POSITIVE, token_ratio=POSITIVE)

    def __init__(self, max_tokens: float = 100.0, token_ratio: float = 0.1) -> None:
        self.BOUNDS.check(locals())
        if token_ratio > max_tokens:
            raise SandboxArgumentError(f"RetryBudget: token_ratio must be in (0, max_tokens], not {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self._tokens = self.max_tokens

    def __repr__(self) -> str:
        return f"RetryBudget(max_tokens={self.max_tokens:g}, token_ratio={self.token_ratio:g}, tokens={self._tokens:g})"

    @property
    def tokens(self) -> float:
        return self._tokens

    def on_failure(self) -> bool:
        """Spend a token for a retryable failure; return whether a retry is allowed now."""
        self._tokens = max(0.0, self._tokens - 1.0)
        return self._tokens > self.max_tokens / 2

    def on_success(self) -> None:
        self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)


class _Instruments(InstrumentBundle):
    create_retries: Counter = counter(
        "gym.sandbox.create_retry_total", "1", "Sandbox-create attempts a provider retried."
    )
    retries: Counter = counter("gym.sandbox.retry_total", "1", "Retried attempts of other sandbox operations.")
    throttled: Counter = counter(
        "gym.sandbox.retry_throttled_total", "1", "Retries refused by the retry budget; the error propagated at once."
    )


class RetryMiddleware(ProviderMiddleware):
    """Retries the operations named in ``operations`` (default: only ``create``) with stamina.

    ``on`` is stamina's: an exception type, a tuple of them, or a predicate that returns whether
    to retry, or the seconds to wait (e.g. from a Retry-After hint). The default,
    ``DEFAULT_RETRY_ON``, covers create failures of this package and of NeMo Gym's providers
    (``SANDBOX_CREATE_ERRORS``) and ``ConnectionError``. Keyword arguments a provider adds to an
    operation pass through to every attempt. ``attempts``, ``timeout``
    (total, in seconds) and the ``wait_*`` backoff settings are stamina's too.

    ``exec`` is not retried unless named: a command may have run. ``close`` may be named
    (releasing is idempotent for correct providers).

    ``attempt_timeout`` bounds each attempt; the attempt then raises ``TimeoutError``. **A create
    attempt that timed out may have created a sandbox** that nobody holds: it is retried only if
    ``TimeoutError`` is covered by ``on``, which the default is not.

    Every retried attempt adds 1 to ``gym.sandbox.create_retry_total`` (other operations:
    ``gym.sandbox.retry_total`` with ``operation``), logs one warning (operation, attempt number,
    wait, error) from the same place, and adds a ``retry`` event to the current span (the
    ``TracingMiddleware`` span when tracing sits outside).

    ``budget``, a ``RetryBudget``, is shared by every call through this layer: while it is
    exhausted the error propagates at once and ``gym.sandbox.retry_throttled_total`` counts it.
    Cancellation is never retried and never swallowed. The first attempt runs without stamina: a call
    that succeeds at once sets up no retry state; a failure is handed to stamina as its first attempt.
    """

    BOUNDS: ClassVar[Bounds] = Bounds(
        "RetryMiddleware",
        attempts=AT_LEAST_ONE.or_none(),
        timeout=POSITIVE.or_none(),
        wait_initial=NON_NEGATIVE,
        wait_max=NON_NEGATIVE,
        wait_jitter=NON_NEGATIVE,
        attempt_timeout=POSITIVE.or_none(),
    )

    def __init__(
        self,
        inner: SandboxProvider,
        *,
        on: RetryOn = DEFAULT_RETRY_ON,
        attempts: int | None = 10,
        timeout: float | None = 600.0,
        wait_initial: float = 0.5,
        wait_max: float = 30.0,
        wait_jitter: float = 1.0,
        attempt_timeout: float | None = None,
        operations: Collection[str] = ("create",),
        budget: RetryBudget | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        super().__init__(inner)
        unknown = set(operations) - set(RETRYABLE_OPERATIONS)
        if isinstance(operations, str) or unknown:
            raise SandboxArgumentError(
                f"RetryMiddleware: operations must be a list of {list(RETRYABLE_OPERATIONS)}, got {operations!r}"
            )
        self.BOUNDS.check(locals())
        self.on = on
        self.attempts = attempts
        self.timeout = timeout
        self.wait_initial = wait_initial
        self.wait_max = wait_max
        self.wait_jitter = wait_jitter
        self.attempt_timeout = attempt_timeout
        self.operations = frozenset(operations)
        self.budget = budget
        self._instruments = Instruments(_Instruments.create, meter_provider)
        _check_on(on)

    def __repr__(self) -> str:
        return f"RetryMiddleware({self.inner!r}, operations={sorted(self.operations)}, attempts={self.attempts})"

    def _predicate(self, operation: str) -> Callable[[Exception], bool | float | dt.timedelta]:
        def should_retry(exc: Exception) -> bool | float | dt.timedelta:
            verdict = _verdict(self.on, exc)
            if verdict is False:
                return False
            if self.budget is not None and not self.budget.on_failure():
                self._count("throttled", operation)
                return False
            return verdict

        return should_retry

    def _count(self, which: str, operation: str) -> None:
        instruments = self._instruments.get()
        if instruments is None:
            return
        try:
            if which == "throttled":
                instruments.throttled.add(1, {PROVIDER_ATTR: self.name, OPERATION_ATTR: operation})
            elif operation == "create":
                instruments.create_retries.add(1, {PROVIDER_ATTR: self.name})
            else:
                instruments.retries.add(1, {PROVIDER_ATTR: self.name, OPERATION_ATTR: operation})
        except Exception as exc:
            report_once(f"retry counter ({which})", exc)

    def _retrying_now(self, operation: str, attempt: int, waited: float, error: Exception | None) -> None:
        """The one place a retry is reported: counter, warning and span event agree by construction."""
        self._count("retry", operation)
        logger.warning(
            "retrying %s on %s: attempt %d after waiting %.3fs; previous attempt failed with %r",
            operation,
            self.name,
            attempt,
            waited,
            error,
        )
        try:
            trace.get_current_span().add_event(
                "retry",
                {
                    "operation": operation,
                    "attempt": attempt,
                    "wait_s": waited,
                    "error.type": error_type(error) if error is not None else "",
                },
            )
        except Exception as exc:
            report_once("retry span event", exc)

    @property
    def operations(self) -> frozenset[str]:
        """The operations retried: the only ones that reach ``around``."""
        return self._wrapped

    @operations.setter
    def operations(self, operations: frozenset[str]) -> None:
        self._wrapped = operations

    async def around(self, operation: Operation[T]) -> T:
        name = operation.name
        if name not in self.operations:  # exec by default: a command may have run, never repeat it
            return await operation()
        # The first attempt runs bare: a call that succeeds sets up no retry context (stamina's costs
        # tens of microseconds). Its failure is replayed as stamina's first attempt, which decides.
        started = time.monotonic()
        try:
            # No extra frame for the collector to track while the attempt runs, unless it is bounded.
            result = await (operation() if self.attempt_timeout is None else self._attempt(operation))
        except Exception as exc:
            first = exc
        else:
            if self.budget is not None:
                self.budget.on_success()
            return result
        return await self._retry(operation, first, started)  # outside the except: no implicit chaining

    async def _attempt(self, operation: Operation[T]) -> T:
        if self.attempt_timeout is None:
            return await operation()
        with anyio.fail_after(self.attempt_timeout):
            return await operation()

    async def _retry(self, operation: Operation[T], first: Exception, started: float) -> T:
        """Stamina's retries after a first attempt that raised ``first``: it is stamina's attempt 1
        (the same predicate, budget, backoff and total ``timeout``, counted from ``started``)."""
        name = operation.name
        last_error: Exception = first
        failed_at = time.monotonic()
        timeout = None if self.timeout is None else max(self.timeout - (failed_at - started), 1e-6)
        async for attempt in stamina.retry_context(
            on=self._predicate(name),
            attempts=self.attempts,
            timeout=timeout,
            wait_initial=self.wait_initial,
            wait_max=self.wait_max,
            wait_jitter=self.wait_jitter,
        ):
            with attempt:
                if attempt.num == 1:
                    raise first
                self._retrying_now(name, attempt.num, time.monotonic() - failed_at, last_error)
                try:
                    result = await self._attempt(operation)
                except Exception as exc:
                    last_error, failed_at = exc, time.monotonic()
                    raise
                if self.budget is not None:
                    self.budget.on_success()
                return result
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover


def _is_exception_types(on: object) -> bool:
    if isinstance(on, type):
        return issubclass(on, Exception)
    return isinstance(on, tuple) and all(isinstance(t, type) and issubclass(t, Exception) for t in on)


def _check_on(on: RetryOn) -> None:
    if not _is_exception_types(on) and (isinstance(on, type) or not callable(on)):
        raise SandboxArgumentError(
            f"RetryMiddleware: on must be an exception type, a tuple of them, or a predicate; got {on!r}"
        )


def _verdict(on: RetryOn, exc: Exception) -> bool | float | dt.timedelta:
    """Whether (or after how long) ``on`` retries ``exc``; kept a plain function so layers pickle."""
    if isinstance(on, (type, tuple)):
        return isinstance(exc, on)
    return on(exc)
