"""The layers of a stack, one module each (the core they build on, ``ProviderMiddleware``, is ``.._core``),
and the recommended stack of them (``_recommended.py``)."""

from ._metrics import MetricsMiddleware
from ._ownership import OwnershipMiddleware
from ._recommended import recommended_middleware
from ._release_accounting import HeldSandbox, HeldSnapshot, ReleaseAccountingMiddleware
from ._retry import DEFAULT_RETRY_ON, RetryBudget, RetryMiddleware
from ._tracing import TracingMiddleware
from ._warm_pool import INTERCHANGEABLE_FIELDS, WarmPoolMiddleware
from .admission import (
    QUOTA_CLASSIFIERS,
    AdmissionMiddleware,
    QuotaClassifier,
    QuotaExhausted,
    RateLimited,
    register_quota_classifier,
)

__all__ = [
    "DEFAULT_RETRY_ON",
    "INTERCHANGEABLE_FIELDS",
    "QUOTA_CLASSIFIERS",
    "AdmissionMiddleware",
    "HeldSandbox",
    "HeldSnapshot",
    "MetricsMiddleware",
    "OwnershipMiddleware",
    "QuotaClassifier",
    "QuotaExhausted",
    "RateLimited",
    "ReleaseAccountingMiddleware",
    "RetryBudget",
    "RetryMiddleware",
    "TracingMiddleware",
    "WarmPoolMiddleware",
    "recommended_middleware",
    "register_quota_classifier",
]
