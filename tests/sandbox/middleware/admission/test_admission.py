"""``AdmissionMiddleware``: the provider never sees more than it allows, a 429 waits as told, a quota fails
fast and typed, waiting holds nothing; the same limit across two processes of one host (SQLite)."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import anyio.lowlevel
import pytest

from sandbox_middleware import (
    AdmissionMiddleware,
    LocalProvider,
    Middleware,
    Operation,
    ProviderMiddleware,
    RateLimited,
    RetryBudget,
    RetryMiddleware,
    Sandbox,
    SandboxAdmissionError,
    SandboxArgumentError,
    SandboxCreateError,
    SandboxHandle,
    SandboxQuotaExceededError,
    SandboxSpec,
    register_quota_classifier,
    stack,
)
from sandbox_middleware.middleware.admission._quota import QUOTA_CLASSIFIERS, classify, retry_after_seconds
from sandbox_middleware.testing import FaultInjectingProvider
from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests import ROOT

pytestmark = pytest.mark.anyio


class TooManyRequests(Exception):
    """What an HTTP client raises on a 429: a status code and the response's headers."""

    status_code = 429

    def __init__(self, retry_after: str | None) -> None:
        super().__init__("429 Too Many Requests")
        self.headers = {} if retry_after is None else {"Retry-After": retry_after}


class RateLimitedProvider(FaultInjectingProvider):
    """A provider that answers 429 (Retry-After ``retry_after``) to a create above ``limit`` in the last
    second, and records when each create reached it and when each 429 was sent (time.monotonic)."""

    def __init__(self, limit: float, retry_after: str | None = "0.25", name: str = "scripted") -> None:
        super().__init__(name=name)
        self.limit = limit
        self.retry_after = retry_after
        self.seen: list[float] = []
        self.refused: list[float] = []
        self.creating = 0
        self.peak_creating = 0

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        now = time.monotonic()
        self.seen.append(now)
        if sum(1 for t in self.seen if now - t < 1.0) > self.limit:
            self.refused.append(now)
            raise SandboxCreateError("create failed") from TooManyRequests(self.retry_after)
        self.creating += 1
        self.peak_creating = max(self.peak_creating, self.creating)
        try:
            await anyio.sleep(0.005)
            return await super().create(spec)
        finally:
            self.creating -= 1


def most_in_one_second(times: Sequence[float]) -> int:
    ordered, most, start = sorted(times), 0, 0
    for end, t in enumerate(ordered):
        while t - ordered[start] >= 1.0:
            start += 1
        most = max(most, end - start + 1)
    return most


async def run_creates(provider: Any, count: int, concurrency: int, hold_s: float = 0.0) -> list[BaseException]:
    errors: list[BaseException] = []
    limiter = anyio.CapacityLimiter(concurrency)

    async def one() -> None:
        async with limiter:
            try:
                handle = await provider.create(SandboxSpec())
            except Exception as exc:
                errors.append(exc)
                return
            await anyio.sleep(hold_s)
            await provider.close(handle)

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(one)
    return errors


async def test_the_provider_never_sees_more_than_the_rate(telemetry: TelemetryCapture) -> None:
    """1,000 creates at concurrency 200 with a limit of 400/s: never more than 401 in any second, no 429."""
    inner = RateLimitedProvider(limit=401)
    admission = AdmissionMiddleware(inner, max_create_rate=400, meter_provider=telemetry.meter_provider)
    provider = stack(admission, [Middleware(RetryMiddleware, wait_initial=0.01, wait_jitter=0)])
    errors = await run_creates(provider, 1_000, 200)
    assert errors == [] and inner.refused == []
    assert len(inner.seen) == 1_000 and most_in_one_second(inner.seen) <= 401
    assert inner.alive == set() and admission.held_slots() == 0
    assert telemetry.histogram_count("gym.sandbox.admission.wait_duration_ms") == 1_000
    assert telemetry.value("gym.sandbox.admission.throttled_total", reason="max_create_rate") > 0
    await provider.aclose()


async def test_every_429_waits_as_told_and_is_retried(telemetry: TelemetryCapture) -> None:
    """The provider allows 50/s and says Retry-After 0.25 s: after each 429 no create reaches it for 0.25 s
    (every create of the key waits), the retry layer retries, and every create succeeds in the end."""
    inner = RateLimitedProvider(limit=50, retry_after="0.25")
    admission = AdmissionMiddleware(inner, meter_provider=telemetry.meter_provider)
    retry = dict(attempts=None, timeout=60, wait_initial=0.001, wait_max=0.002, wait_jitter=0)
    provider = stack(admission, [Middleware(RetryMiddleware, **retry, budget=RetryBudget(1_000, 1))])
    errors = await run_creates(provider, 200, 100)
    assert errors == []
    assert inner.refused, "the scripted provider never refused: the test proves nothing"
    for refused in inner.refused:
        later = [t for t in inner.seen if t > refused]
        assert not later or min(later) - refused >= 0.25 - 0.002
    assert telemetry.value("gym.sandbox.admission.throttled_total", reason="rate_limited") == len(inner.refused)
    assert telemetry.value("gym.sandbox.admission.throttled_total", reason="retry_after") > 0
    assert inner.alive == set() and admission.held_slots() == 0
    await provider.aclose()


class DaytonaError(Exception):
    """Named as Daytona's SDK names its errors."""


class QuotaProvider(FaultInjectingProvider):
    def __init__(self, error: BaseException, name: str) -> None:
        super().__init__(name=name)
        self.error = error

    async def create(self, spec: SandboxSpec, **extensions: Any) -> SandboxHandle:
        self.calls["create"] += 1
        raise SandboxCreateError("Failed to create sandbox") from self.error


async def test_a_hard_quota_fails_at_once_typed_and_is_not_retried(telemetry: TelemetryCapture) -> None:
    inner = QuotaProvider(DaytonaError("Total disk quota exceeded (100 GiB) for organization acme"), "daytona")
    admission = AdmissionMiddleware(inner, meter_provider=telemetry.meter_provider)
    provider = stack(admission, [Middleware(RetryMiddleware, attempts=5, wait_initial=0.01)])
    with pytest.raises(SandboxQuotaExceededError) as caught:
        await provider.create(SandboxSpec())
    assert inner.calls["create"] == 1  # not retried
    assert caught.value.quota == "disk" and caught.value.provider == "daytona"
    assert "quota 'disk' exhausted" in str(caught.value) and "not retried" in str(caught.value)
    assert telemetry.value("gym.sandbox.admission.throttled_total", reason="quota") == 1
    assert pickle.loads(pickle.dumps(caught.value)).quota == "disk"
    await provider.aclose()


class RateLimitException(Exception):
    """Named as E2B's SDK names its 429."""


def test_the_classification_table() -> None:
    """Each provider's own entries, the generic ones, the cause chain, and an entry of one's own."""
    e2b = SandboxCreateError("could not create")
    e2b.__cause__ = RateLimitException("Rate limit exceeded")
    assert isinstance(classify("e2b", e2b), RateLimited)
    assert classify("local", e2b) is None  # E2B's class name means nothing for another provider
    assert classify("any", TooManyRequests("3")) == RateLimited(3.0, "HTTP 429")
    assert classify("any", RuntimeError("status code: 429 from server")) == RateLimited(None, "HTTP 429")
    assert classify("any", RuntimeError("connection reset")) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_seconds("soon") is None and retry_after_seconds("nan") is None

    class CapacityError(Exception):
        pass

    def capacity(exc: BaseException) -> Any:
        return RateLimited(5.0, "no capacity") if isinstance(exc, CapacityError) else None

    def broken(exc: BaseException) -> Any:
        raise KeyError("a classifier with a bug")

    register_quota_classifier("mine", capacity)
    register_quota_classifier("mine", broken)
    try:
        assert classify("mine", CapacityError()) == RateLimited(5.0, "no capacity")  # the bug is logged, not raised
    finally:
        del QUOTA_CLASSIFIERS["mine"]


async def test_caps_on_concurrent_creates_and_held() -> None:
    inner = RateLimitedProvider(limit=10_000)
    admission = AdmissionMiddleware(inner, max_concurrent_creates=3, max_held=7)
    peak_held = 0

    async def watch() -> None:
        nonlocal peak_held
        while True:
            peak_held = max(peak_held, len(inner.alive))
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        assert await run_creates(admission, 60, 30, hold_s=0.01) == []
        tg.cancel_scope.cancel()
    assert inner.peak_creating == 3 and 1 < peak_held <= 7
    assert inner.alive == set() and admission.held_slots() == 0


async def test_a_create_cancelled_while_waiting_takes_no_slot() -> None:
    inner = FaultInjectingProvider()
    admission = AdmissionMiddleware(inner, max_held=1, max_create_rate=1)
    first = await admission.create(SandboxSpec())
    with anyio.move_on_after(0.05) as waiting:
        await admission.create(SandboxSpec())  # waits for the held slot
    assert waiting.cancelled_caught and inner.calls["create"] == 1
    assert await admission._backend.call("taken", "held") == 1
    await admission.close(first)
    assert await admission._backend.call("taken", "held") == 0
    with anyio.fail_after(5):  # the slot is free; the rate token was not spent by the cancelled one
        second = await admission.create(SandboxSpec())
    await admission.close(second)
    assert inner.alive == set()
    await admission.aclose()


class _Arrivals(random.Random):
    """Start jitters given in order, one per create (0 past them): the creates reach the layer when told."""

    def __init__(self, jitters: list[float]) -> None:
        super().__init__()
        self._jitters = jitters

    def uniform(self, a: float, b: float) -> float:
        return self._jitters.pop(0) if self._jitters else 0.0


async def test_two_groups_forking_at_once_under_max_held_never_each_hold_part(sandbox_base: Path) -> None:
    """Two prepared parents fork 4 each with room for one group of forks (max_held = 2 parents + 4), their
    creates reaching the layer interleaved (start jitter): one group takes its 4 slots in one step, the
    other waits holding none and is made once the first group's forks are closed. One create at a time,
    the groups took 2 slots each and waited for each other until create_timeout_s."""
    provider = stack(
        LocalProvider(isolation="none", base_dir=sandbox_base, prestart=False),
        [Middleware(AdmissionMiddleware, max_held=6, start_jitter_s=3.0)],
    )
    admission = cast("AdmissionMiddleware", provider)
    first, second = [0.0, 0.6, 1.2, 1.8], [0.3, 0.9, 1.5, 2.1]  # whichever group starts first, they interleave
    admission._random = _Arrivals([0.0, 0.0, *first, *second])
    events: list[tuple[str, str]] = []
    held: list[int] = []  # slots taken while each group's forks lived
    prepared: list[str] = []
    both = anyio.Event()

    async def session(name: str) -> None:
        async with Sandbox(provider, create_timeout_s=20) as parent:  # its forks' bound too
            await parent.exec(f"echo {name} > state")
            prepared.append(name)
            if len(prepared) == 2:
                both.set()
            await both.wait()
            async with parent.fork(4) as forks:
                events.append(("forked", name))
                states = {(await fork.exec("cat state")).stdout for fork in forks}
                assert states == {f"{name}\n"}
                held.append(await admission._backend.call("taken", "held"))
                await anyio.sleep(0.3)
                events.append(("closed", name))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for name in ("a", "b"):
                    group.start_soon(session, name)
        assert [event for event, _ in events] == ["forked", "closed", "forked", "closed"], events
        assert held[0] == 6  # both parents and the first group's 4 (the second's parent may be gone by its turn)
        assert await admission._backend.call("taken", "held") == 0  # no slot a group took is left
    finally:
        await provider.aclose()


T = TypeVar("T")


class _FailsThirdCreate(ProviderMiddleware):
    """Fails the third create once: below admission before the provider makes it (its held slot goes
    back to its group), or above it (``after``) once admission handed the sandbox back, closing it (as
    a layer between can, or an attempt's timeout): its group then needs a slot past those it took."""

    _wrapped = frozenset({"create"})

    def __init__(self, inner: Any, *, after: bool) -> None:
        super().__init__(inner)
        self.after, self.creates = after, 0

    async def around(self, operation: Operation[T]) -> T:
        self.creates += 1
        if self.creates != 3:
            return await operation()
        if self.after:
            await self.inner.close(cast("SandboxHandle", await operation()))
        raise SandboxCreateError("the third create fails, once")


@pytest.mark.parametrize("after", [False, True], ids=["below", "above"])
async def test_a_group_s_failed_create_is_retried_while_another_group_waits(after: bool) -> None:
    """Two parents fork 4 each with room for one group of forks (max_held = 2 + 4); the first group's
    first fork fails once and is retried while the second group waits for 4 slots: the retry gets a
    slot (its own back, or the one its close freed) ahead of that wait, so the groups are made in
    turn. Queued behind the second group's wait, the retry waited for it until create_timeout_s."""
    faulty = FaultInjectingProvider(latency={"create": 0.3})
    admission = AdmissionMiddleware(faulty if after else _FailsThirdCreate(faulty, after=False), max_held=6)
    layers = _FailsThirdCreate(admission, after=True) if after else admission
    provider = RetryMiddleware(layers, wait_initial=0.01, wait_jitter=0)
    events: list[str] = []

    async def forks_of(parent: Sandbox, name: str) -> None:
        async with parent.fork(4) as forks:
            events.append(f"forked {name}: {len(forks)}")
            await anyio.sleep(0.2)
            events.append(f"closed {name}")

    try:
        with anyio.fail_after(30):
            async with (
                Sandbox(provider, create_timeout_s=10) as a,
                Sandbox(provider, create_timeout_s=10) as b,
                anyio.create_task_group() as group,
            ):
                group.start_soon(forks_of, a, "a")
                await anyio.sleep(0.1)  # a's group has its 4 slots, b's waits for 4
                group.start_soon(forks_of, b, "b")
        assert events == ["forked a: 4", "closed a", "forked b: 4", "closed b"]
        assert await admission._backend.call("taken", "held") == 0 and not faulty.alive
    finally:
        await provider.aclose()


async def test_a_group_larger_than_max_held_is_refused_in_words(sandbox_base: Path) -> None:
    provider = stack(
        LocalProvider(isolation="none", base_dir=sandbox_base, prestart=False),
        [Middleware(AdmissionMiddleware, max_held=4)],
    )
    admission = cast("AdmissionMiddleware", provider)
    try:
        async with Sandbox(provider, create_timeout_s=20) as parent:  # a group waiting for what never comes: bounded
            with pytest.raises(SandboxAdmissionError, match=r"group of 5 creates .* over max_held=4: raise max_held"):
                await parent.fork(5)
            with pytest.raises(SandboxAdmissionError, match=r"4 held slots at once beside its parent's, over max_hel"):
                await parent.fork(4)  # the parent holds one of the 4 while they are made
            assert await admission._backend.call("taken", "held") == 1  # the parent's, and nothing more
            assert admission.held_slots() == 1
            async with parent.fork(3) as forks:  # room for the parent and 3
                assert len(forks) == 3
        assert await admission._backend.call("taken", "held") == 0
    finally:
        await provider.aclose()


def test_bad_options_are_refused_in_words() -> None:
    with pytest.raises(SandboxArgumentError, match="max_create_rate must be > 0"):
        AdmissionMiddleware(FaultInjectingProvider(), max_create_rate=0)
    with pytest.raises(SandboxArgumentError, match="shared must be 'process', 'host' or 'ray'"):
        AdmissionMiddleware(FaultInjectingProvider(), shared="cluster")  # type: ignore[arg-type]
    with pytest.raises(SandboxArgumentError, match="shared_path"):
        AdmissionMiddleware(FaultInjectingProvider(), shared_path=Path("x.sqlite"))


def test_a_layer_pickles_with_its_options_not_its_state(tmp_path: Path) -> None:
    layer = AdmissionMiddleware(FaultInjectingProvider(), max_create_rate=5, shared="host", shared_path=tmp_path / "l")
    copy = pickle.loads(pickle.dumps(layer))
    assert (copy.max_create_rate, copy.shared, copy.shared_path) == (5, "host", tmp_path / "l")
    with pytest.raises(TypeError, match="meter_provider"):
        pickle.dumps(AdmissionMiddleware(FaultInjectingProvider(), meter_provider=TelemetryCapture().meter_provider))


# -- across processes ----------------------------------------------------------------------------


async def shared_creates(shared: str, key: str, path: str | None, count: int, rate: float) -> list[float]:
    """One process's (or Ray worker's) share: ``count`` creates at concurrency 100 under a shared limit;
    returns when each reached the provider (time.monotonic, one clock for the whole host)."""
    inner = RateLimitedProvider(limit=10_000)
    options: dict[str, Any] = {"shared": shared, "shared_key": key, "max_create_rate": rate, "max_held": 150}
    if path is not None:
        options["shared_path"] = Path(path)
    admission = AdmissionMiddleware(inner, **options)
    errors = await run_creates(admission, count, 100, hold_s=0.01)
    assert errors == [] and inner.alive == set()
    await admission.aclose()
    return inner.seen


def _worker(path: str, count: int, rate: float, out: str) -> None:
    seen = anyio.run(shared_creates, "host", "two-processes", path, count, rate)
    Path(out).write_text(json.dumps(seen))


def test_two_processes_share_one_limit(tmp_path: Path) -> None:
    """Two processes, 250 creates each at concurrency 100, one limit of 125/s through one SQLite file:
    the provider (both processes together) never sees more than 126 in any second."""
    ledger = tmp_path / "admission.sqlite"
    code = (
        "import sys; from tests.sandbox.middleware.admission.test_admission import _worker; "
        "_worker(sys.argv[1], 250, 125, sys.argv[2])"
    )
    outs = [tmp_path / f"seen-{n}.json" for n in range(2)]
    workers = [subprocess.Popen([sys.executable, "-c", code, str(ledger), str(out)], cwd=ROOT) for out in outs]
    try:
        assert [worker.wait(timeout=120) for worker in workers] == [0, 0]
    finally:
        for worker in workers:
            worker.kill()
    seen = [t for out in outs for t in json.loads(out.read_text())]
    assert len(seen) == 500
    assert most_in_one_second(seen) <= 126
    both = [json.loads(out.read_text()) for out in outs]
    assert min(max(part) for part in both) > max(min(part) for part in both)  # they really ran at the same time


class _StuckBackend:
    """A shared ledger that never answers ``stuck`` operations and fails ``forget``."""

    shared = True

    def __init__(self, stuck: str) -> None:
        self.stuck = stuck
        self.closed = False

    def __repr__(self) -> str:
        return "StuckBackend()"

    async def call(self, operation: str, *args: Any) -> Any:
        if operation == self.stuck:
            await anyio.sleep_forever()
        if operation == "forget":
            raise SandboxAdmissionError("the ledger is gone")
        return (0.0, None) if operation == "take" else True

    async def aclose(self) -> None:
        self.closed = True


async def test_a_ledger_that_does_not_answer_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a bare TimeoutError out of create."""
    monkeypatch.setattr("sandbox_middleware.middleware.admission._middleware._CALL_TIMEOUT_S", 0.2)
    inner = FaultInjectingProvider()
    admission = AdmissionMiddleware(inner)
    admission._backend = _StuckBackend("take")
    with pytest.raises(SandboxAdmissionError, match=r"StuckBackend\(\) did not answer take within 0\.2 s"):
        await admission.create(SandboxSpec())
    assert inner.calls["create"] == 0


async def test_aclose_releases_the_ledger_when_forget_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing forget skipped the backend's aclose (its SQLite connection stayed open)."""
    inner = FaultInjectingProvider()
    closed: list[str] = []

    async def inner_aclose() -> None:
        closed.append("inner")

    monkeypatch.setattr(inner, "aclose", inner_aclose)
    admission = AdmissionMiddleware(inner)
    backend = admission._backend = _StuckBackend("none")
    with pytest.raises(SandboxAdmissionError, match="the ledger is gone"):
        await admission.aclose()
    assert backend.closed and closed == ["inner"]
