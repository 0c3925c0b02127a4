"""The chain's floor: what a step sees (``Exchange``), what a source offers (``Candidate``), the
step base (``TokenMiddleware``) and the innermost handler (``require_bundle``).

The sources and checks (``_chain``, ``_vllm_responses``) build on these; ``tokens.chain`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._bundle import TokenBundle
from ._decode import DecodedResponse
from ._errors import ConflictingTokenMetadataError, MissingTokenMetadataError, TokenCaptureError

TokenizeFn = Callable[[Mapping[str, Any]], Awaitable[list[int]]]


@dataclass(frozen=True, slots=True)
class Candidate:
    """What one token source in the response carries for one choice; a field it lacks is None.

    ``problem`` (set when a field is missing) is the error raised if this source wins; a source of
    lower precedence is only cross-checked on the ids it does carry.
    """

    source: str
    prompt_token_ids: list[int] | None
    generation_token_ids: list[int] | None
    generation_log_probs: list[float] | None
    problem: TokenCaptureError | None = None
    routed_experts: Any = None

    def bundle(self) -> TokenBundle:
        """The bundle of a complete source; its ``problem`` otherwise."""
        if self.problem is not None:
            raise self.problem
        assert self.prompt_token_ids is not None and self.generation_token_ids is not None
        assert self.generation_log_probs is not None
        return TokenBundle(
            self.prompt_token_ids,
            self.generation_token_ids,
            self.generation_log_probs,
            self.source,
            self.routed_experts,
        )


@dataclass
class Exchange:
    """One choice of a completion as the chain sees it: the request sent, the decoded response,
    the choice's ``index``, the bundle found so far and the bundles of the choices before it.
    The chain runs once per choice, in choice order."""

    request: Mapping[str, Any]
    response: DecodedResponse
    tokenize: TokenizeFn | None = None
    allow_tokenize_fallback: bool = False
    """Whether a request that asked for inline ids may fall back to ``/tokenize`` when none came back."""
    found: TokenBundle | None = None
    index: int = 0
    group: Sequence[TokenBundle] = ()
    """The bundles of the choices before this one (``n`` > 1), in choice order."""

    def offer(self, candidate: Candidate) -> None:
        """The first source offered wins (it must be complete); every later one must agree with it
        on the ids it carries."""
        found = self.found
        if found is None:
            self.found = candidate.bundle()
            return
        for name in ("prompt_token_ids", "generation_token_ids"):
            mine, theirs = getattr(candidate, name), getattr(found, name)
            if mine is not None and mine is not theirs and mine != theirs:
                raise ConflictingTokenMetadataError(
                    f"{name}: the {found.source!r} source and the {candidate.source!r} source in one response "
                    f"disagree {describe_difference(theirs, mine)}; the response cannot be trusted for training"
                )


Handler = Callable[[Exchange], Awaitable[TokenBundle]]


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int:
    """The first index where they differ (the shorter length when one is a prefix of the other)."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return index
    return min(len(expected), len(actual))


def describe_difference(a: Sequence[int], b: Sequence[int]) -> str:
    index = first_difference(a, b)
    if index < min(len(a), len(b)):
        return f"at index {index} ({a[index]} vs {b[index]})"
    return f"in length ({len(a)} vs {len(b)})"


async def require_bundle(exchange: Exchange) -> TokenBundle:
    """The innermost handler: the bundle a source found, or ``MissingTokenMetadataError``."""
    if exchange.found is None:
        choice = f"choices[{exchange.index}]"
        raise MissingTokenMetadataError(
            f"the response has no token source: no bundle on {choice}.message, no inline ids "
            f"(prompt_token_ids / {choice}.token_ids) and no {choice}.logprobs.content; request "
            "logprobs=true (TokenClient does) or return_token_ids=true"
        )
    return exchange.found


class TokenMiddleware:
    """Base of a chain step: holds ``inner``; ``__call__`` passes the exchange on unchanged."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        return await self.inner(exchange)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class PureSource(TokenMiddleware):
    """A step backed by one pure extraction function: offer what it finds, then go on."""

    extract: Callable[[DecodedResponse, int], Candidate | None]

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        candidate = type(self).extract(exchange.response, exchange.index)
        if candidate is not None:
            exchange.offer(candidate)
        return await self.inner(exchange)
