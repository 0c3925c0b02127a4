"""``Trajectory``: multi-turn token sequences for training, with drift detection.

In a multi-turn rollout each turn's prompt should start with the previous prompt plus the tokens
the model generated. When it does not (a chat template that strips earlier reasoning, a tool call
re-tokenized differently, a separator dropped at the boundary), the tokens trained on are not the
ones the model conditioned on, and the importance ratio is silently wrong. ``Trajectory`` checks
every turn, says where the sequences diverge, and applies a policy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from .._bundle import TokenBundle, TokenCompletion
from .._errors import TokensError
from .._exchange import first_difference
from ._order import order_records

__all__ = ["Drift", "DriftPolicy", "Segment", "Trajectory", "TrajectoryDriftError"]

DriftPolicy = Literal["error", "split", "mask"]


@dataclass(frozen=True)
class Drift:
    """Where turn ``turn``'s prompt stopped extending the previous prompt plus generation."""

    turn: int
    """0-based index of the turn whose prompt diverged."""
    index: int
    """First position (in that prompt) that differs from the expected prefix."""
    window_start: int
    expected: list[int]
    """The expected ids (previous prompt + generation) from ``window_start``."""
    actual: list[int]
    """The prompt's ids from ``window_start``."""
    expected_text: str | None = None
    actual_text: str | None = None

    def describe(self) -> str:
        text = (
            f"turn {self.turn}: the prompt diverges from the previous prompt + generation at index {self.index}; "
            f"from index {self.window_start} expected {self.expected} but got {self.actual}"
        )
        if self.expected_text is not None or self.actual_text is not None:
            text += f" (expected text {self.expected_text!r}, actual text {self.actual_text!r})"
        return text


class TrajectoryDriftError(TokensError):
    """A turn's prompt does not extend the previous prompt + generation (policy ``error``)."""

    def __init__(self, drift: Drift) -> None:
        super().__init__(
            drift.describe() + ". The chat template or the client rewrote history; train on split segments "
            "(policy='split'), mask this trajectory (policy='mask'), or send required_prefix_token_ids"
        )
        self.drift = drift


TrajectoryDriftError.__module__ = "tokens"


@dataclass
class Segment:
    """A token sequence ready for a trainer: ids, a loss mask (1 = generated, trained on) and the
    sampled log probabilities aligned with them (0.0 on prompt tokens). A generated token whose log
    probability is the server's -9999.0 floor keeps it but gets mask 0."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    trainable: bool = True
    """False when the policy ``mask`` kept a drifted trajectory going: do not train on it."""
    turns: int = 0

    def _extend(self, ids: list[int], mask: int, log_probs: list[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    def _extend_generation(self, bundle: TokenBundle) -> None:
        """The generated tokens, trained on (mask 1), except where the server gave no real log
        probability (its -9999.0 floor): an importance ratio cannot be computed there (mask 0)."""
        start = len(self.token_ids)
        self._extend(bundle.generation_token_ids, 1, bundle.generation_log_probs)
        for position in bundle.floored_positions:
            self.loss_mask[start + position] = 0

    def _truncate(self, length: int) -> None:
        del self.token_ids[length:], self.loss_mask[length:], self.log_probs[length:]


class Trajectory:
    """Feed it each turn's ``TokenCompletion`` (or ``TokenBundle``) in order.

    Each prompt must start with the previous prompt + generation, with one exception: when the
    generation's last token is in ``boundary_token_ids``, the prompt may hold any token of
    ``boundary_token_ids`` in its place (templates re-render an end-of-turn token, e.g.
    ``<|endoftext|>`` as ``<|im_end|>``). Any other difference, a missing token included, is drift.
    Tokens the template appends after the generation (separators, the next user or tool message)
    are prompt tokens with loss mask 0.

    On a divergence, ``policy`` decides: ``error`` raises ``TrajectoryDriftError``; ``split``
    closes the segment and starts a new one from the new prompt; ``mask`` keeps one segment,
    rebased on the new prompt from the divergence on, and marks it untrainable. Every divergence
    is also recorded in ``drifts``. ``decode`` (ids -> text) adds the text around it.
    """

    def __init__(
        self,
        *,
        policy: DriftPolicy = "error",
        boundary_token_ids: Collection[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        window: int = 8,
    ) -> None:
        if policy not in ("error", "split", "mask"):
            raise ValueError(f"Trajectory: policy must be 'error', 'split' or 'mask', not {policy!r}")
        if window < 1:
            raise ValueError(f"Trajectory: window must be at least 1, not {window}")
        self.policy: DriftPolicy = policy
        self.boundary_token_ids = frozenset(boundary_token_ids)
        self.decode = decode
        self.window = window
        self.segments: list[Segment] = []
        self.drifts: list[Drift] = []
        self._turns = 0

    @classmethod
    def from_snapshot(cls, snapshot: Any, **options: Any) -> Trajectory:
        """The trajectory of a frozen rollout (``tokens.records``: a ``TokenCaptureSnapshot``, or any
        iterable of records): its records in chain order, delta prompts rebuilt and checked against
        their digests, added as turns. ``options`` are the constructor's (``policy=`` ...)."""
        trajectory = cls(**options)
        for _, bundle in order_records(getattr(snapshot, "entries", snapshot)):
            trajectory.add(bundle)
        return trajectory

    @property
    def required_prefix_token_ids(self) -> list[int] | None:
        """The previous prompt + generation: what the next prompt must start with (None before a turn)."""
        return list(self.segments[-1].token_ids) if self.segments else None

    def add(self, turn: TokenCompletion | TokenBundle) -> Drift | None:
        """Add one turn; the drift found at it (already handled per the policy), or None."""
        bundle = turn.bundle if isinstance(turn, TokenCompletion) else turn
        prompt = bundle.prompt_token_ids
        number = self._turns
        self._turns += 1
        if not self.segments:
            self._start(prompt, bundle)
            return None
        segment = self.segments[-1]
        expected = segment.token_ids
        length = len(expected)
        if prompt[:length] == expected:
            matched = length
        else:
            matched = first_difference(expected, prompt)
            if not self._re_rendered_boundary(segment, prompt, matched):
                drift = self._drift(number, matched, expected, prompt)
                self.drifts.append(drift)
                if self.policy == "error":
                    raise TrajectoryDriftError(drift)
                if self.policy == "split":
                    self._start(prompt, bundle)
                    return drift
                segment.trainable = False
            segment._truncate(matched)
        segment._extend(prompt[matched:], 0)
        segment._extend_generation(bundle)
        segment.turns += 1
        return self.drifts[-1] if self.drifts and self.drifts[-1].turn == number else None

    def _re_rendered_boundary(self, segment: Segment, prompt: list[int], matched: int) -> bool:
        """Whether the only difference is the generation's last token, a boundary token, written by
        the template as a boundary token (itself or another): the one allowed difference."""
        boundary = self.boundary_token_ids
        return (
            matched == len(segment.token_ids) - 1
            and segment.loss_mask[-1] == 1
            and segment.token_ids[-1] in boundary
            and matched < len(prompt)
            and prompt[matched] in boundary
        )

    def _start(self, prompt: list[int], bundle: TokenBundle) -> None:
        segment = Segment()
        segment._extend(prompt, 0)
        segment._extend_generation(bundle)
        segment.turns = 1
        self.segments.append(segment)

    def _drift(self, turn: int, index: int, expected: list[int], actual: list[int]) -> Drift:
        start = max(0, index - self.window)
        want, got = expected[start : index + self.window], actual[start : index + self.window]
        decode = self.decode
        return Drift(
            turn,
            index,
            start,
            want,
            got,
            decode(want) if decode is not None else None,
            decode(got) if decode is not None else None,
        )
