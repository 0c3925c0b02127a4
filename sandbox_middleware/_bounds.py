"""What a numeric option accepts, declared once beside the parameters it bounds.

A class lists its numeric options' bounds in ``BOUNDS``, next to its ``__init__``; the constructor
checks its arguments with ``BOUNDS.check(locals())`` and the config validator (``_config.py``) reads the
same ``BOUNDS``, so a value one refuses the other refuses too, with the same words: the
constructor raises ``SandboxArgumentError``, the config lists the problem in its ``ConfigError``.

Every bounded number is finite (NaN and the infinities are refused; ``None``, where an option
allows it, means "no limit"), and never a ``bool``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from ._errors import SandboxArgumentError

__all__ = ["AT_LEAST_ONE", "NON_NEGATIVE", "NON_NEGATIVE_WHOLE", "POSITIVE", "Bound", "Bounds", "bounds_of"]


def _plain(number: float) -> str:
    """A bound as a person writes it: 16777216, not 1.67772e+07."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


@dataclass(frozen=True, slots=True)
class Bound:
    """A finite number ``>= low`` (``> low`` with ``strict``), at most ``high``; ``whole``: an int
    (a float is refused, even one with no fraction, as the config refuses it); ``optional``: None
    is allowed and means "no limit"."""

    low: float
    strict: bool = False
    high: float | None = None
    whole: bool = False
    optional: bool = False

    def or_none(self) -> Bound:
        """This bound, with None allowed ("no limit")."""
        return replace(self, optional=True)

    def at_most(self, high: float) -> Bound:
        return replace(self, high=high)

    def __str__(self) -> str:
        text = f"{'>' if self.strict else '>='} {_plain(self.low)}"
        return text if self.high is None else f"{text} and <= {_plain(self.high)}"

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` ("must be ..., not ..."), or None when it is accepted."""
        if value is None and self.optional:
            return None
        wrong_type = self.whole and isinstance(value, float)
        if wrong_type or isinstance(value, bool) or not isinstance(value, int | float):
            # worded as the config words a value its annotation refuses
            kind = ("int" if self.whole else "float") + (" or null" if self.optional else "")
            return f"must be {kind}, not {value!r:.80} ({type(value).__name__})"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, not {value!r}" + (" (null means no limit)" if self.optional else "")
        too_low = value <= self.low if self.strict else value < self.low
        if too_low or (self.high is not None and value > self.high):
            return f"must be {self}, not {value!r:.80}"
        return None

    def check(self, value: object, what: str) -> None:
        """Raise ``SandboxArgumentError`` naming ``what`` unless ``value`` is accepted."""
        problem = self.problem(value)
        if problem is not None:
            raise SandboxArgumentError(f"{what} {problem}")


POSITIVE = Bound(0, strict=True)
NON_NEGATIVE = Bound(0)
AT_LEAST_ONE = Bound(1, whole=True)
NON_NEGATIVE_WHOLE = Bound(0, whole=True)


class Bounds(Mapping[str, Bound]):
    """The bounds of one class's numeric options, by parameter name; ``check`` is the constructor's."""

    __slots__ = ("_bounds", "owner")

    def __init__(self, owner: str, **bounds: Bound) -> None:
        self.owner = owner
        self._bounds = bounds

    def __getitem__(self, name: str) -> Bound:
        return self._bounds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._bounds)

    def __len__(self) -> int:
        return len(self._bounds)

    def __repr__(self) -> str:
        return f"Bounds({self.owner!r}, {', '.join(f'{k}={v}' for k, v in self._bounds.items())})"

    def check(self, arguments: Mapping[str, object]) -> None:
        """Every bounded option's value in ``arguments`` (the constructor's ``locals()``, so none is
        forgotten); the first one refused raises ``SandboxArgumentError`` ("Owner: name must be ...")."""
        for name, bound in self._bounds.items():
            bound.check(arguments[name], f"{self.owner}: {name}")


def bounds_of(cls: object) -> Mapping[str, Bound]:
    """The ``BOUNDS`` a class declares (or inherits); empty for a class without."""
    found = getattr(cls, "BOUNDS", None)
    return found if isinstance(found, Bounds) else {}
