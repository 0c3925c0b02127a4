"""The token bundle and the completion that carries it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LOG_PROB_FLOOR", "TokenBundle", "TokenCompletion", "WeightVersionSpan"]

LOG_PROB_FLOOR = -9999.0
"""The log probability a server writes where it computed none (see ``TokenBundle.floored_positions``)."""


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Generation tokens ``[start, end)`` were sampled by weights labelled ``version`` (vLLM's
    ``weight_versions`` entries; versions are strings, as vLLM reports them)."""

    version: str
    start: int
    end: int


@dataclass(frozen=True, slots=True, eq=False)
class TokenBundle:
    """The tokens of one turn exactly as the server used them.

    The lists are the very objects decoded from the response (no copies), so treat them as
    read-only. ``source`` says where they came from: ``message`` (a bundle already on
    ``choice.message``), ``dynamo`` (``nvext.engine_data``), ``sglang`` or ``vllm`` (inline ids), or
    ``tokenize`` (generation from logprobs, prompt reconstructed by ``/tokenize``: not ``exact``).
    """

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    source: str
    routed_experts: Any = None
    floored_positions: tuple[int, ...] = ()
    """Positions whose log probability is the server's -9999.0 floor (no real value was computed)."""
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    """Which policy version sampled which generation tokens, when the server said (vLLM's
    ``/inference/v1/generate``) or the caller did; empty when unknown."""

    @property
    def exact(self) -> bool:
        """True when every id came from the server inline; False when the prompt was reconstructed."""
        return self.source != "tokenize"

    def __repr__(self) -> str:
        return (
            f"TokenBundle(source={self.source!r}, prompt={len(self.prompt_token_ids)} ids, "
            f"generation={len(self.generation_token_ids)} ids)"
        )


@dataclass(frozen=True, slots=True)
class TokenCompletion:
    """A chat completion response (dict) with each choice's bundle on its message, and the bundles.

    ``bundles`` holds one bundle per choice, in choice order (``n`` > 1 gives several, sharing the
    prompt ids); ``bundle`` is the first choice's.
    """

    response: dict[str, Any]
    bundles: tuple[TokenBundle, ...]

    @property
    def bundle(self) -> TokenBundle:
        """The first choice's bundle (the only one unless ``n`` > 1)."""
        return self.bundles[0]

    def __repr__(self) -> str:  # the response can be megabytes: never print it whole
        return f"TokenCompletion(id={self.response.get('id')!r}, bundles={list(self.bundles)!r})"
