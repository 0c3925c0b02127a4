"""Trajectory: multi-turn token sequences, drift detection and the training output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokens import Drift, TokenBundle, Trajectory, TrajectoryDriftError
from tokens.chain import decode_response, extract_vllm_inline

FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm-0.32"
EOS, THINK, END_THINK = 3, 90, 91
SYSTEM_USER = [2, 10, 11, 12, 3, 2, 20, 21]  # a rendered system + user turn


def bundle(prompt: list[int], generation: list[int], base: float = -0.5) -> TokenBundle:
    return TokenBundle(prompt, generation, [base - i / 10 for i in range(len(generation))], "vllm")


def real(name: str) -> TokenBundle:
    found = extract_vllm_inline(decode_response((FIXTURES / f"{name}.response.json").read_bytes()))
    assert found is not None
    return found.bundle()


def test_real_two_turn_vllm_sequence_is_append_only() -> None:
    """The captured turn-2 prompt extends turn 1's prompt + generation (the template adds <|im_end|>)."""
    first, second = real("chat_inline_ids"), real("chat_turn2")
    prefix = first.prompt_token_ids + first.generation_token_ids
    trajectory = Trajectory(boundary_token_ids={3})
    assert trajectory.add(first) is None
    assert trajectory.required_prefix_token_ids == prefix
    assert trajectory.add(second) is None
    assert second.prompt_token_ids[: len(prefix)] == prefix  # the direct comparison agrees
    [segment] = trajectory.segments
    assert segment.token_ids == second.prompt_token_ids + second.generation_token_ids
    assert sum(segment.loss_mask) == len(first.generation_token_ids) + len(second.generation_token_ids)


def test_append_only_template_builds_one_segment_with_aligned_mask() -> None:
    """Prompt, tool and user tokens get mask 0; generated tokens mask 1 with their log probabilities."""
    turn1 = bundle(SYSTEM_USER, [40, 41, EOS])
    tool = [2, 50, 51, 3]
    turn2 = bundle([*SYSTEM_USER, 40, 41, EOS, *tool], [42, EOS], base=-1.0)
    trajectory = Trajectory()
    trajectory.add(turn1)
    trajectory.add(turn2)
    [segment] = trajectory.segments
    assert segment.token_ids == [*SYSTEM_USER, 40, 41, EOS, *tool, 42, EOS]
    assert segment.loss_mask == [0] * 8 + [1, 1, 1] + [0] * 4 + [1, 1]
    assert len(segment.log_probs) == len(segment.token_ids)
    assert segment.log_probs[8:11] == turn1.generation_log_probs
    assert segment.log_probs[15:] == turn2.generation_log_probs
    assert all(lp == 0.0 for lp, m in zip(segment.log_probs, segment.loss_mask, strict=True) if m == 0)
    assert segment.trainable and segment.turns == 2 and trajectory.drifts == []


def test_boundary_token_added_by_the_template_is_a_prompt_token() -> None:
    """A length-cut generation followed by the template's end-of-turn token is not drift."""
    trajectory = Trajectory()
    trajectory.add(bundle(SYSTEM_USER, [40, 41]))
    assert trajectory.add(bundle([*SYSTEM_USER, 40, 41, EOS, 2, 30], [43])) is None
    assert trajectory.segments[0].loss_mask[-4:] == [0, 0, 0, 1]


def test_generated_boundary_token_replaced_by_the_template() -> None:
    """A generated end token re-rendered as another boundary id is allowed only when configured."""
    turn1 = bundle(SYSTEM_USER, [40, 41, 4])  # stopped on id 4 (e.g. <|endoftext|>)
    turn2 = bundle([*SYSTEM_USER, 40, 41, EOS, 2, 30], [43])  # the template writes <|im_end|>
    with pytest.raises(TrajectoryDriftError, match="at index 10"):
        strict = Trajectory()
        strict.add(turn1)
        strict.add(turn2)
    tolerant = Trajectory(boundary_token_ids={3, 4})
    tolerant.add(turn1)
    assert tolerant.add(turn2) is None
    [segment] = tolerant.segments
    assert segment.token_ids == [*turn2.prompt_token_ids, 43]
    assert segment.loss_mask[8:11] == [1, 1, 0]  # the replaced end token was not what the model saw


REASONING = [THINK, 60, 61, END_THINK, 40, 41, EOS]
STRIPPED = [*SYSTEM_USER, 40, 41, EOS, 2, 30, 31, 3, 2]  # the template dropped the earlier reasoning


def two_turns(policy: str) -> Trajectory:
    trajectory = Trajectory(policy=policy, decode=lambda ids: " ".join(f"<{i}>" for i in ids), window=3)  # type: ignore[arg-type]
    trajectory.add(bundle(SYSTEM_USER, REASONING))
    trajectory.add(bundle(STRIPPED, [44, EOS]))
    return trajectory


def test_stripped_reasoning_raises_at_the_right_index() -> None:
    """Policy error: TrajectoryDriftError at the first diverging index, with ids and text around it."""
    with pytest.raises(TrajectoryDriftError) as info:
        two_turns("error")
    drift: Drift = info.value.drift
    assert drift.turn == 1 and drift.index == len(SYSTEM_USER)
    assert drift.window_start == len(SYSTEM_USER) - 3
    assert drift.expected == SYSTEM_USER[-3:] + REASONING[:3]
    assert drift.actual == STRIPPED[5:11]
    assert drift.expected_text is not None and "<90>" in drift.expected_text
    assert "<40>" in (drift.actual_text or "")
    assert "diverges from the previous prompt + generation at index 8" in str(info.value)


def test_stripped_reasoning_split() -> None:
    """Policy split: the first segment is kept whole and a new one starts from the new prompt."""
    trajectory = two_turns("split")
    first, second = trajectory.segments
    assert first.token_ids == SYSTEM_USER + REASONING and first.trainable
    assert second.token_ids == [*STRIPPED, 44, EOS]
    assert second.loss_mask == [0] * len(STRIPPED) + [1, 1] and second.trainable
    assert [d.index for d in trajectory.drifts] == [len(SYSTEM_USER)]


def test_stripped_reasoning_mask() -> None:
    """Policy mask: one segment, rebased on the actual prompt from the divergence, marked untrainable."""
    trajectory = two_turns("mask")
    [segment] = trajectory.segments
    assert not segment.trainable
    assert segment.token_ids == [*STRIPPED, 44, EOS]
    assert segment.loss_mask == [0] * len(STRIPPED) + [1, 1]
    assert len(segment.log_probs) == len(segment.token_ids)
    assert trajectory.drifts[0].index == len(SYSTEM_USER)
    assert trajectory.required_prefix_token_ids == [*STRIPPED, 44, EOS]


def test_prompt_that_is_a_strict_prefix_is_drift() -> None:
    """A prompt shorter than the previous prompt + generation diverges where it ends."""
    trajectory = Trajectory(policy="split")
    trajectory.add(bundle(SYSTEM_USER, [40, 41]))
    drift = trajectory.add(bundle(SYSTEM_USER[:5], [40]))
    assert drift is not None and drift.index == 5


def test_bad_options() -> None:
    """An unknown policy or a zero window is refused at construction."""
    with pytest.raises(ValueError, match="policy must be"):
        Trajectory(policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        Trajectory(window=0)


def test_turn_2_request_matches_sample() -> None:
    """The captured turn-2 request fed back exactly the first answer's text (a sanity check of the fixtures)."""
    request = json.loads((FIXTURES / "chat_turn2.request.json").read_text())
    first = json.loads((FIXTURES / "chat_inline_ids.response.json").read_text())
    assert request["messages"][2]["content"] == first["choices"][0]["message"]["content"]


def test_floored_log_probs_are_not_trained_on() -> None:
    """A generated token at the server's -9999.0 floor gets loss mask 0 (no importance ratio exists there)."""
    floored = TokenBundle([1, 2], [5, 6, 7], [-0.1, -9999.0, -0.3], "vllm", floored_positions=(1,))
    trajectory = Trajectory()
    trajectory.add(floored)
    trajectory.add(bundle([1, 2, 5, 6, 7, 3], [8]))
    [segment] = trajectory.segments
    assert segment.loss_mask == [0, 0, 1, 0, 1, 0, 1]
    assert segment.log_probs[3] == -9999.0


def test_boundary_token_replaced_by_a_non_boundary_token_is_drift() -> None:
    """Only a boundary token may stand where the generated boundary token was: [..41, 3] then [..41, 99, ..]
    is drift at the 3's index (the issue's case), and a prompt that stops before it is too."""
    turn1 = bundle(SYSTEM_USER, [40, 41, EOS])
    trajectory = Trajectory(boundary_token_ids={EOS, 4})
    trajectory.add(turn1)
    with pytest.raises(TrajectoryDriftError, match="at index 10") as raised:
        trajectory.add(bundle([*SYSTEM_USER, 40, 41, 99, 2, 30], [43]))
    assert raised.value.drift.expected[-1] == EOS and 99 in raised.value.drift.actual
    for allowed in (EOS, 4):
        tolerant = Trajectory(boundary_token_ids={EOS, 4})
        tolerant.add(turn1)
        assert tolerant.add(bundle([*SYSTEM_USER, 40, 41, allowed, 2, 30], [43])) is None
    cut = Trajectory(boundary_token_ids={EOS, 4})
    cut.add(turn1)
    with pytest.raises(TrajectoryDriftError, match="at index 10"):
        cut.add(bundle([*SYSTEM_USER, 40, 41], [43]))
