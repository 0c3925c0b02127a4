"""Which create failures say "too many" (wait and retry) and which say "quota exhausted" (fail now).

``QUOTA_CLASSIFIERS`` maps a provider's ``name`` to its classifiers, ``"*"`` to those every provider
gets; ``register_quota_classifier`` extends it. A classifier looks at one exception (the chain
``__cause__`` / ``__context__`` is walked for it) and returns ``RateLimited``, ``QuotaExhausted`` or
None. The admission layer asks ``classify`` about every failed create; nothing here imports a
provider's SDK: errors are recognised by their class names, status attributes and messages.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..._errors import SandboxQuotaExceededError, SandboxRateLimitedError
from ..._telemetry import report_once

__all__ = [
    "QUOTA_CLASSIFIERS",
    "QuotaClassifier",
    "QuotaExhausted",
    "RateLimited",
    "classify",
    "http_429",
    "register_quota_classifier",
]


@dataclass(frozen=True, slots=True)
class RateLimited:
    """The provider refused for now: wait ``retry_after_s`` (None: it did not say) and ask again."""

    retry_after_s: float | None = None
    why: str = "HTTP 429"


@dataclass(frozen=True, slots=True)
class QuotaExhausted:
    """A hard quota is used up: asking again cannot succeed. ``quota`` names it (``"disk"``, ...)."""

    quota: str
    why: str = "quota exhausted"


Verdict: TypeAlias = RateLimited | QuotaExhausted
QuotaClassifier: TypeAlias = Callable[[BaseException], Verdict | None]

_CHAIN_DEPTH = 8


def retry_after_seconds(value: object, *, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: a number of seconds or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                return None
            seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _headers(exc: BaseException) -> Mapping[str, Any] | None:
    for owner in (exc, getattr(exc, "response", None)):
        headers = getattr(owner, "headers", None)
        if isinstance(headers, Mapping) or hasattr(headers, "get"):
            return headers
    return None


def _status(exc: BaseException) -> object:
    for owner in (exc, getattr(exc, "response", None)):
        for attribute in ("status_code", "status"):
            value = getattr(owner, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


_TOO_MANY = re.compile(r"\b(?:http|status(?: code)?:?)\s*429\b|\b429 too many requests\b|\btoo many requests\b", re.I)


def http_429(exc: BaseException) -> Verdict | None:
    """An HTTP 429 (a ``status_code`` / ``status`` of 429 on the error or its ``response``, or a
    message saying so), with ``Retry-After`` from its headers or a ``retry_after`` attribute."""
    if isinstance(exc, SandboxRateLimitedError):  # an admission layer further in already decided
        return RateLimited(exc.retry_after_s, "rate-limited below")
    if _status(exc) != 429 and not _TOO_MANY.search(str(exc)):
        return None
    headers = _headers(exc)
    after = retry_after_seconds(getattr(exc, "retry_after", None))
    if after is None and headers is not None:
        after = retry_after_seconds(headers.get("Retry-After") or headers.get("retry-after"))
    return RateLimited(after, "HTTP 429")


_QUOTA_MESSAGE = re.compile(
    r"(?:total\s+)?(?P<name>[a-z]+)?\s*quota\s+(?:exceeded|exhausted|reached)|insufficient\s+(?P<other>[a-z]+)?\s*quota",
    re.I,
)


def quota_message(exc: BaseException) -> Verdict | None:
    """A message saying a quota is exceeded / exhausted / reached ("Total disk quota exceeded")."""
    if isinstance(exc, SandboxQuotaExceededError):
        return QuotaExhausted(exc.quota, "quota exhausted below")
    match = _QUOTA_MESSAGE.search(str(exc))
    if match is None:
        return None
    name = (match.group("name") or match.group("other") or "").lower()
    return QuotaExhausted(name if name and name not in ("the", "your", "a") else "unknown")


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _named_rate_limit(exc: BaseException, class_name: str, why: str) -> Verdict | None:
    """A rate limit when ``exc`` is of a class named ``class_name``, with its ``retry_after`` if any."""
    if class_name in _class_names(exc):
        return RateLimited(retry_after_seconds(getattr(exc, "retry_after", None)), why)
    return None


def e2b(exc: BaseException) -> Verdict | None:
    """E2B's SDK: ``RateLimitException`` (its 429, also sent at the concurrent-sandbox limit)."""
    return _named_rate_limit(exc, "RateLimitException", "E2B RateLimitException")


def daytona(exc: BaseException) -> Verdict | None:
    """Daytona's SDK: ``DaytonaRateLimitError``; its organisation quotas say "Total disk quota exceeded"."""
    return _named_rate_limit(exc, "DaytonaRateLimitError", "DaytonaRateLimitError")


def modal(exc: BaseException) -> Verdict | None:
    """Modal's SDK: a ``RateLimitError`` (sandbox creation is limited per second)."""
    if "RateLimitError" in _class_names(exc) and "modal" in type(exc).__module__:
        return RateLimited(None, "Modal RateLimitError")
    return None


QUOTA_CLASSIFIERS: dict[str, list[QuotaClassifier]] = {
    "*": [http_429, quota_message],
    "e2b": [e2b],
    "daytona": [daytona],
    "modal": [modal],
}
"""Classifiers by provider ``name`` (``"*"``: every provider); a provider's own ones are asked first."""


def register_quota_classifier(provider: str, classifier: QuotaClassifier) -> None:
    """Ask ``classifier`` about ``provider``'s failed creates (``"*"``: every provider's), before the others."""
    QUOTA_CLASSIFIERS.setdefault(provider, []).insert(0, classifier)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _CHAIN_DEPTH:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def classify(provider: str, exc: BaseException) -> Verdict | None:
    """What ``exc`` (a failed create of ``provider``) says about limits, or None; never raises.

    A hard quota anywhere in the chain wins over a rate limit (a 429 that says "quota exceeded" is a quota).
    """
    classifiers = [*QUOTA_CLASSIFIERS.get(provider, ()), *QUOTA_CLASSIFIERS.get("*", ())]
    found: Verdict | None = None
    for error in _chain(exc):
        for classifier in classifiers:
            try:
                verdict = classifier(error)
            except Exception as failure:  # a classifier of someone else's must not turn into the error
                report_once(f"quota classifier {getattr(classifier, '__name__', classifier)!r}", failure)
                continue
            if isinstance(verdict, QuotaExhausted):
                return verdict
            if found is None and isinstance(verdict, RateLimited):
                found = verdict
    return found
