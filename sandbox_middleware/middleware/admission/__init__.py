"""The admission layer: ``AdmissionMiddleware`` (``_middleware.py``), its ledger of admitted creates
(``_ledger.py``, on this host or in a Ray actor: ``_ray.py``) and which failures say "too many" (``_quota.py``)."""

from ._middleware import AdmissionMiddleware
from ._quota import QUOTA_CLASSIFIERS, QuotaClassifier, QuotaExhausted, RateLimited, register_quota_classifier

__all__ = [
    "QUOTA_CLASSIFIERS",
    "AdmissionMiddleware",
    "QuotaClassifier",
    "QuotaExhausted",
    "RateLimited",
    "register_quota_classifier",
]
