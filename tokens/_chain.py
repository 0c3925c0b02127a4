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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._bundle import TokenBundle
from ._decode import DecodedResponse
from ._errors import (
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
)

__all__ = [
    "DEFAULT_CHAIN",
    "Exchange",
    "Handler",
    "LogprobsSource",
    "MessageBundleSource",
    "TokenMiddleware",
    "VLLMInlineSource",
    "build_chain",
    "extract_message_bundle",
    "extract_vllm_inline",
    "require_bundle",
]

TokenizeFn = Callable[[Mapping[str, Any]], Awaitable[list[int]]]


@dataclass
class Exchange:
    """One completion as the chain sees it: the request sent, the decoded response, the bundle so far."""

    request: Mapping[str, Any]
    response: DecodedResponse
    tokenize: TokenizeFn | None = None
    found: TokenBundle | None = None
    sources: list[str] = field(default_factory=list)

    def offer(self, bundle: TokenBundle) -> None:
        """Take ``bundle`` if nothing was found yet; otherwise require it to agree with what was."""
        self.sources.append(bundle.source)
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


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"at index {index} ({x} vs {y})"
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


def extract_message_bundle(response: DecodedResponse) -> TokenBundle | None:
    """A complete bundle already on ``choices[0].message`` (as NeMo RL attaches it), or None."""
    present = [name for name in _MESSAGE_FIELDS if response.present(name)]
    if not present:
        return None
    if len(present) < len(_MESSAGE_FIELDS):
        missing = [name for name in _MESSAGE_FIELDS if name not in present]
        raise PartialTokenMetadataError(
            f"choices[0].message carries {', '.join(present)} but not {', '.join(missing)}; a bundle on the "
            "message must have all three fields"
        )
    prompt = response.token_ids(_MESSAGE_FIELDS[0])
    generation = response.token_ids(_MESSAGE_FIELDS[1])
    log_probs = response.log_probs(_MESSAGE_FIELDS[2])
    assert prompt is not None and generation is not None and log_probs is not None
    _lengths_match(generation, log_probs, _MESSAGE_FIELDS[1], _MESSAGE_FIELDS[2])
    return TokenBundle(prompt, generation, log_probs, "message", _routed_experts(response))


def extract_vllm_inline(response: DecodedResponse) -> TokenBundle | None:
    """vLLM's inline ids (``return_token_ids``): top-level ``prompt_token_ids`` and
    ``choices[0].token_ids``, log probabilities from ``choices[0].logprobs``; or None."""
    has_prompt = response.present("prompt_token_ids")
    has_generation = response.present("choices[0].token_ids")
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
    return TokenBundle(prompt, generation, log_probs, "vllm", _routed_experts(response))


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


class VLLMInlineSource(_PureSource):
    """vLLM inline ids with logprobs (source ``vllm``)."""

    extract = staticmethod(extract_vllm_inline)


class LogprobsSource(TokenMiddleware):
    """Generation ids and log probabilities from ``choices[0].logprobs.content``; the prompt ids from
    ``/tokenize`` (source ``tokenize``), called only when no source before it found a bundle."""

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        from_logprobs = exchange.response.logprob_tokens()
        if from_logprobs is not None:
            ids, log_probs = from_logprobs
            found = exchange.found
            if found is not None:
                if ids != found.generation_token_ids:
                    raise ConflictingTokenMetadataError(
                        f"generation_token_ids from the {found.source!r} source and the ids in "
                        f"choices[0].logprobs.content disagree {_first_difference(found.generation_token_ids, ids)}"
                    )
            else:
                if exchange.tokenize is None:
                    raise MissingTokenMetadataError(
                        "the response has generation tokens in logprobs but no prompt ids, and no /tokenize "
                        "fallback is configured"
                    )
                prompt = await exchange.tokenize(tokenize_body(exchange.request))
                exchange.offer(TokenBundle(prompt, ids, log_probs, "tokenize", _routed_experts(exchange.response)))
        return await self.inner(exchange)


ChainEntry = Callable[[Handler], Handler]
DEFAULT_CHAIN: tuple[ChainEntry, ...] = (MessageBundleSource, VLLMInlineSource, LogprobsSource)


def build_chain(entries: Sequence[ChainEntry] = DEFAULT_CHAIN, inner: Handler = require_bundle) -> Handler:
    """Build the chain around ``inner``; the first entry is the outermost (highest precedence)."""
    handler = inner
    for entry in reversed(entries):
        handler = entry(handler)
    return handler
