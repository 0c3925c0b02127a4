"""The response-middleware chain that turns a decoded response into a ``TokenBundle``.

Each step wraps an inner handler (``async (Exchange) -> TokenBundle``), onion-shaped like the
sandbox provider stack: the first entry of a chain is the outermost. A step looks for its own
source in the response; the first source found wins (precedence = order), and every later source
present must agree with it (``ConflictingTokenMetadataError``). The innermost handler,
``require_bundle``, returns the winner or raises ``MissingTokenMetadataError``.

Extraction is done by small pure functions over the ``DecodedResponse``; the only HTTP is
``Exchange.tokenize``, which the client supplies and ``LogprobsSource`` calls when no inline source
gave the prompt ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._bundle import TokenBundle
from ._decode import DecodedResponse
from ._errors import (
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    TokenIdsIgnoredError,
)

__all__ = [
    "DEFAULT_CHAIN",
    "LOG_PROB_FLOOR",
    "DynamoSource",
    "Exchange",
    "Handler",
    "LogProbFloorCheck",
    "LogprobsSource",
    "MessageBundleSource",
    "SGLangSource",
    "TokenMiddleware",
    "UsageCheck",
    "VLLMInlineSource",
    "build_chain",
    "extract_dynamo",
    "extract_message_bundle",
    "extract_sglang",
    "extract_vllm_inline",
    "require_bundle",
]

logger = logging.getLogger("tokens")

TokenizeFn = Callable[[Mapping[str, Any]], Awaitable[list[int]]]


@dataclass
class Exchange:
    """One completion as the chain sees it: the request sent, the decoded response, the bundle so far."""

    request: Mapping[str, Any]
    response: DecodedResponse
    tokenize: TokenizeFn | None = None
    allow_tokenize_fallback: bool = False
    """Whether a request that asked for inline ids may fall back to ``/tokenize`` when none came back."""
    found: TokenBundle | None = None

    def offer(self, bundle: TokenBundle) -> None:
        """Take ``bundle`` if nothing was found yet; otherwise require it to agree with what was."""
        found = self.found
        if found is None:
            self.found = bundle
            return
        for name in ("prompt_token_ids", "generation_token_ids"):
            mine, theirs = getattr(bundle, name), getattr(found, name)
            if mine is not theirs and mine != theirs:
                raise ConflictingTokenMetadataError(
                    f"{name}: the {found.source!r} source and the {bundle.source!r} source in one response "
                    f"disagree {_first_difference(theirs, mine)}; the response cannot be trusted for training"
                )


Handler = Callable[[Exchange], Awaitable[TokenBundle]]


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int:
    """The first index where they differ (the shorter length when one is a prefix of the other)."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return index
    return min(len(expected), len(actual))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    index = first_difference(a, b)
    if index < min(len(a), len(b)):
        return f"at index {index} ({a[index]} vs {b[index]})"
    return f"in length ({len(a)} vs {len(b)})"


async def require_bundle(exchange: Exchange) -> TokenBundle:
    """The innermost handler: the bundle a source found, or ``MissingTokenMetadataError``."""
    if exchange.found is None:
        raise MissingTokenMetadataError(
            "the response has no token source: no bundle on choices[0].message, no inline ids "
            "(prompt_token_ids / choices[0].token_ids) and no choices[0].logprobs.content; request "
            "logprobs=true (TokenClient does) or return_token_ids=true"
        )
    return exchange.found


def _routed_experts(response: DecodedResponse) -> Any:
    routed = response.choice.get("routed_experts")
    return routed if routed is not None else response.message.get("routed_experts")


def _lengths_match(ids: list[int], log_probs: list[float], ids_field: str, log_probs_field: str) -> None:
    if len(ids) != len(log_probs):
        raise MalformedTokenMetadataError(
            f"{ids_field} has {len(ids)} ids but {log_probs_field} has {len(log_probs)} log probabilities; "
            "they must pair one to one"
        )


_MESSAGE_FIELDS = (
    "choices[0].message.prompt_token_ids",
    "choices[0].message.generation_token_ids",
    "choices[0].message.generation_log_probs",
)


def _three_field_bundle(response: DecodedResponse, fields: tuple[str, str, str], source: str,
                        hint: str) -> TokenBundle | None:  # fmt: skip
    """A bundle from three held fields (prompt ids, generation ids, log probabilities): all or none."""
    present = [name for name in fields if response.present(name)]
    if not present:
        return None
    if len(present) < len(fields):
        missing = [name for name in fields if name not in present]
        raise PartialTokenMetadataError(
            f"the response carries {', '.join(present)} but not {', '.join(missing)}; {hint}"
        )
    prompt = response.token_ids(fields[0])
    generation = response.token_ids(fields[1])
    log_probs = response.log_probs(fields[2])
    assert prompt is not None and generation is not None and log_probs is not None
    _lengths_match(generation, log_probs, fields[1], fields[2])
    return TokenBundle(prompt, generation, log_probs, source, _routed_experts(response))


def extract_message_bundle(response: DecodedResponse) -> TokenBundle | None:
    """A complete bundle already on ``choices[0].message`` (as NeMo RL attaches it), or None."""
    return _three_field_bundle(response, _MESSAGE_FIELDS, "message", "a bundle on the message must have all three")


def extract_vllm_inline(response: DecodedResponse) -> TokenBundle | None:
    """vLLM's inline ids (``return_token_ids``): top-level ``prompt_token_ids`` and
    ``choices[0].token_ids``, log probabilities from ``choices[0].logprobs``; or None."""
    has_prompt = response.present("prompt_token_ids")
    # choice.token_ids beside choice.prompt_token_ids is SGLang's shape, not half of vLLM's.
    has_generation = response.present("choices[0].token_ids") and not response.present("choices[0].prompt_token_ids")
    if not (has_prompt or has_generation):
        return None
    if not (has_prompt and has_generation):
        there, absent = (
            ("prompt_token_ids", "choices[0].token_ids") if has_prompt else ("choices[0].token_ids", "prompt_token_ids")
        )
        raise PartialTokenMetadataError(
            f"the response has vLLM inline {there} but no {absent}; vLLM sends both with return_token_ids=true"
        )
    prompt = response.token_ids("prompt_token_ids")
    generation = response.token_ids("choices[0].token_ids")
    assert prompt is not None and generation is not None
    from_logprobs = response.logprob_tokens()
    if from_logprobs is None:
        raise MissingTokenMetadataError(
            "the response has vLLM inline ids but no choices[0].logprobs.content for their log probabilities; "
            "request logprobs=true (TokenClient does)"
        )
    ids, log_probs = from_logprobs
    _lengths_match(generation, log_probs, "choices[0].token_ids", "choices[0].logprobs.content")
    if ids != generation:
        where = _first_difference(generation, ids)
        raise ConflictingTokenMetadataError(
            f"choices[0].token_ids and the ids in choices[0].logprobs.content disagree {where}"
        )
    response.logprobs_verified = True
    return TokenBundle(prompt, generation, log_probs, "vllm", _routed_experts(response))


_DYNAMO_FIELDS = (
    "nvext.engine_data.prompt_token_ids",
    "nvext.engine_data.completion_token_ids",
    "nvext.engine_data.completion_logprobs",
)


def extract_dynamo(response: DecodedResponse) -> TokenBundle | None:
    """NVIDIA Dynamo's ``nvext.engine_data`` (requested with ``nvext: {extra_fields: ["engine_data"]}``):
    ``prompt_token_ids``, ``completion_token_ids`` and ``completion_logprobs``; or None."""
    return _three_field_bundle(
        response, _DYNAMO_FIELDS, "dynamo",
        "Dynamo's engine_data must have all three (is the backend old, or were log probabilities not requested?)",
    )  # fmt: skip


def extract_sglang(response: DecodedResponse) -> TokenBundle | None:
    """SGLang's inline ids (``return_token_ids``): ``choices[0].prompt_token_ids`` and
    ``choices[0].token_ids``, log probabilities from ``choices[0].logprobs.content``; or None."""
    has_prompt = response.present("choices[0].prompt_token_ids")
    if not has_prompt:
        return None
    if not response.present("choices[0].token_ids"):
        raise PartialTokenMetadataError(
            "the response has SGLang inline choices[0].prompt_token_ids but no choices[0].token_ids; "
            "SGLang sends both with return_token_ids=true"
        )
    prompt = response.token_ids("choices[0].prompt_token_ids")
    generation = response.token_ids("choices[0].token_ids")
    assert prompt is not None and generation is not None
    entries = response.logprob_entries()
    if entries is None:
        raise MissingTokenMetadataError(
            "the response has SGLang inline ids but no choices[0].logprobs.content for their log probabilities; "
            "request logprobs=true (TokenClient does)"
        )
    log_probs = [entry.logprob for entry in entries]
    _lengths_match(generation, log_probs, "choices[0].token_ids", "choices[0].logprobs.content")
    return TokenBundle(prompt, generation, log_probs, "sglang", _routed_experts(response))


_TOKENIZE_FIELDS = ("model", "messages", "tools", "chat_template_kwargs", "mm_processor_kwargs",
                    "required_prefix_token_ids")  # fmt: skip


def tokenize_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body: exactly the prompt-affecting fields present in the request."""
    return {name: request[name] for name in _TOKENIZE_FIELDS if name in request}


class TokenMiddleware:
    """Base of a chain step: holds ``inner``; ``__call__`` passes the exchange on unchanged."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        return await self.inner(exchange)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class _PureSource(TokenMiddleware):
    """A step backed by one pure extraction function: offer what it finds, then go on."""

    extract: Callable[[DecodedResponse], TokenBundle | None]

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        bundle = type(self).extract(exchange.response)
        if bundle is not None:
            exchange.offer(bundle)
        return await self.inner(exchange)


class MessageBundleSource(_PureSource):
    """A complete bundle on ``choices[0].message`` (source ``message``)."""

    extract = staticmethod(extract_message_bundle)


class DynamoSource(_PureSource):
    """NVIDIA Dynamo's ``nvext.engine_data`` (source ``dynamo``)."""

    extract = staticmethod(extract_dynamo)


class SGLangSource(_PureSource):
    """SGLang's inline ids on the choice (source ``sglang``)."""

    extract = staticmethod(extract_sglang)


class VLLMInlineSource(_PureSource):
    """vLLM inline ids with logprobs (source ``vllm``)."""

    extract = staticmethod(extract_vllm_inline)


class LogprobsSource(TokenMiddleware):
    """Generation ids and log probabilities from ``choices[0].logprobs.content``; the prompt ids from
    ``/tokenize`` (source ``tokenize``), called only when no source before it found a bundle.

    When an earlier source found the bundle, the logprob tokens are a cross-check of its
    generation ids (skipped when the server wrote tokens as text rather than ``token_id:<int>``).
    """

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        found = exchange.found
        if found is not None:
            if exchange.response.logprobs_verified:
                # Already compared with the generation of a source that agreed with ``found``: each list once.
                return await self.inner(exchange)
            try:
                from_logprobs = exchange.response.logprob_tokens()
            except MalformedTokenMetadataError:
                from_logprobs = None  # text tokens: nothing to compare ids with
            if from_logprobs is not None and from_logprobs[0] != found.generation_token_ids:
                where = _first_difference(found.generation_token_ids, from_logprobs[0])
                raise ConflictingTokenMetadataError(
                    f"generation_token_ids from the {found.source!r} source and the ids in "
                    f"choices[0].logprobs.content disagree {where}"
                )
            return await self.inner(exchange)
        from_logprobs = exchange.response.logprob_tokens()
        if from_logprobs is not None:
            if exchange.request.get("return_token_ids") and not exchange.allow_tokenize_fallback:
                raise TokenIdsIgnoredError(
                    "the request asked for return_token_ids but the server sent no inline ids (an older vLLM, or "
                    "a server that ignores the field); the prompt would have to be re-tokenized. Upgrade the "
                    "server, or pass allow_tokenize_fallback=True to accept reconstructed prompt ids"
                )
            if exchange.tokenize is None:
                raise MissingTokenMetadataError(
                    "the response has generation tokens in logprobs but no prompt ids, and no /tokenize "
                    "fallback is configured"
                )
            ids, log_probs = from_logprobs
            prompt = await exchange.tokenize(tokenize_body(exchange.request))
            exchange.offer(TokenBundle(prompt, ids, log_probs, "tokenize", _routed_experts(exchange.response)))
        return await self.inner(exchange)


LOG_PROB_FLOOR = -9999.0


class UsageCheck(TokenMiddleware):
    """After extraction: ``usage.prompt_tokens`` / ``usage.completion_tokens``, when present, must
    equal the bundle's list lengths (``ConflictingTokenMetadataError``)."""

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        bundle = await self.inner(exchange)
        usage = exchange.response.body.get("usage")
        if isinstance(usage, dict):
            for key, ids in (
                ("prompt_tokens", bundle.prompt_token_ids),
                ("completion_tokens", bundle.generation_token_ids),
            ):
                count = usage.get(key)
                if isinstance(count, int) and not isinstance(count, bool) and count != len(ids):
                    raise ConflictingTokenMetadataError(
                        f"usage.{key} is {count} but the {bundle.source!r} source has {len(ids)} ids; the server's "
                        "accounting and its token lists disagree"
                    )
        return bundle


class LogProbFloorCheck(TokenMiddleware):
    """After extraction: log probabilities at the server's -9999.0 floor (no real value was
    computed) are reported in ``TokenBundle.floored_positions`` and logged, not passed off as numbers."""

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        bundle = await self.inner(exchange)
        log_probs = bundle.generation_log_probs
        if LOG_PROB_FLOOR not in log_probs:
            return bundle
        positions = tuple(i for i, value in enumerate(log_probs) if value == LOG_PROB_FLOOR)
        logger.warning(
            "%d generated token(s) carry the server's -9999.0 log-probability floor (positions %s); "
            "see TokenBundle.floored_positions",
            len(positions),
            list(positions[:20]),
        )
        return dataclasses.replace(bundle, floored_positions=positions)


ChainEntry = Callable[[Handler], Handler]
DEFAULT_CHAIN: tuple[ChainEntry, ...] = (
    UsageCheck,
    LogProbFloorCheck,
    MessageBundleSource,
    DynamoSource,
    SGLangSource,
    VLLMInlineSource,
    LogprobsSource,
)


def build_chain(entries: Sequence[ChainEntry] = DEFAULT_CHAIN, inner: Handler = require_bundle) -> Handler:
    """Build the chain around ``inner``; the first entry is the outermost (highest precedence)."""
    handler = inner
    for entry in reversed(entries):
        handler = entry(handler)
    return handler
