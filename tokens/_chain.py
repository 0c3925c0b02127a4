"""The response-middleware chain that turns a decoded response into a ``TokenBundle``.

Each step wraps an inner handler (``async (Exchange) -> TokenBundle``), onion-shaped like the
sandbox provider stack: the first entry of a chain is the outermost. A step looks for its own
source in the response; the first source found wins (precedence = order) and must be complete, and
every later source present must agree with it on the ids it carries (``ConflictingTokenMetadataError``),
complete or not. The innermost handler,
``require_bundle``, returns the winner or raises ``MissingTokenMetadataError``.

Extraction is done by small pure functions over the ``DecodedResponse``; the only HTTP is
``Exchange.tokenize``, which the client supplies and ``LogprobsSource`` calls when no inline source
gave the prompt ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._bundle import LOG_PROB_FLOOR, TokenBundle
from ._decode import DecodedResponse
from ._errors import (
    ChoiceCountError,
    ConflictingTokenMetadataError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
    PartialTokenMetadataError,
    TokenCaptureError,
    TokenIdsIgnoredError,
)
from ._exchange import Candidate, Exchange, Handler, PureSource, TokenMiddleware, describe_difference, require_bundle
from ._vllm_responses import VLLMResponsesSource

# The public names are re-exported, with the decoding and request helpers, by ``tokens.chain``.

logger = logging.getLogger("tokens")


def _routed_experts(response: DecodedResponse, index: int) -> Any:
    routed = response.choices[index].get("routed_experts")
    return routed if routed is not None else response.messages[index].get("routed_experts")


def _id_tokens(entries: list[Any]) -> bool:
    """Whether logprob entries carry ids (``token_id:<int>``, as requested) rather than text."""
    return not entries or entries[0].token.startswith("token_id:")


def _lengths_match(ids: list[int], log_probs: list[float], ids_field: str, log_probs_field: str) -> None:
    if len(ids) != len(log_probs):
        raise MalformedTokenMetadataError(
            f"{ids_field} has {len(ids)} ids but {log_probs_field} has {len(log_probs)} log probabilities; "
            "they must pair one to one"
        )


def _three_field_source(
    response: DecodedResponse, fields: tuple[str, str, str], source: str, hint: str, index: int
) -> Candidate | None:
    """Three held fields (prompt ids, generation ids, log probabilities), or None if none is there."""
    present = [name for name in fields if response.present(name)]
    if not present:
        return None
    prompt = response.token_ids(fields[0])
    generation = response.token_ids(fields[1])
    log_probs = response.log_probs(fields[2])
    problem = None
    if len(present) < len(fields):
        missing = [name for name in fields if name not in present]
        problem = PartialTokenMetadataError(
            f"the response carries {', '.join(present)} but not {', '.join(missing)}; {hint}"
        )
    elif generation is not None and log_probs is not None:
        _lengths_match(generation, log_probs, fields[1], fields[2])
    return Candidate(source, prompt, generation, log_probs, problem, _routed_experts(response, index))


def extract_message_bundle(response: DecodedResponse, index: int = 0) -> Candidate | None:
    """A bundle already on ``choices[index].message`` (as NeMo RL attaches it), or None."""
    prefix = f"choices[{index}].message."
    fields = (prefix + "prompt_token_ids", prefix + "generation_token_ids", prefix + "generation_log_probs")
    return _three_field_source(response, fields, "message", "a bundle on the message must have all three", index)


def extract_vllm_inline(response: DecodedResponse, index: int = 0) -> Candidate | None:
    """vLLM's inline ids (``return_token_ids``): top-level ``prompt_token_ids`` and
    ``choices[index].token_ids``, log probabilities from ``choices[index].logprobs``; or None."""
    choice = f"choices[{index}]"
    has_prompt = response.present("prompt_token_ids")
    # choice.token_ids beside choice.prompt_token_ids is SGLang's shape, not half of vLLM's.
    has_generation = response.present(f"{choice}.token_ids") and not response.present(f"{choice}.prompt_token_ids")
    if not (has_prompt or has_generation):
        return None
    prompt = response.token_ids("prompt_token_ids")
    generation = response.token_ids(f"{choice}.token_ids") if has_generation else None
    routed = _routed_experts(response, index)
    if not (has_prompt and has_generation):
        there, absent = (
            ("prompt_token_ids", f"{choice}.token_ids") if has_prompt else (f"{choice}.token_ids", "prompt_token_ids")
        )
        problem: TokenCaptureError = PartialTokenMetadataError(
            f"the response has vLLM inline {there} but no {absent}; vLLM sends both with return_token_ids=true"
        )
        return Candidate("vllm", prompt, generation, None, problem, routed)
    assert generation is not None
    entries = response.logprob_entries(index)
    if entries is None:
        return _without_log_probs("vllm", "vLLM", choice, prompt, generation, routed)
    if not _id_tokens(entries):  # tokens as text: the inline ids are the ids, logprobs give the numbers
        log_probs = [entry.logprob for entry in entries]
        _lengths_match(generation, log_probs, f"{choice}.token_ids", f"{choice}.logprobs.content")
        return Candidate("vllm", prompt, generation, log_probs, None, routed)
    ids, log_probs = response.logprob_tokens(index) or ([], [])
    _lengths_match(generation, log_probs, f"{choice}.token_ids", f"{choice}.logprobs.content")
    if ids != generation:
        where = describe_difference(generation, ids)
        raise ConflictingTokenMetadataError(
            f"{choice}.token_ids and the ids in {choice}.logprobs.content disagree {where}"
        )
    return Candidate("vllm", prompt, generation, log_probs, None, routed)


def _without_log_probs(
    source: str,
    server: str,
    choice: str,
    prompt: list[int] | None,
    generation: list[int],
    routed: Any,
) -> Candidate:
    """The candidate of inline ids whose choice has no ``logprobs.content``: it cannot be complete."""
    problem = MissingTokenMetadataError(
        f"the response has {server} inline ids but no {choice}.logprobs.content for their log probabilities; "
        "request logprobs=true (TokenClient does)"
    )
    return Candidate(source, prompt, generation, None, problem, routed)


def extract_dynamo(response: DecodedResponse, index: int = 0) -> Candidate | None:
    """NVIDIA Dynamo's ``nvext.engine_data`` (requested with ``nvext: {extra_fields: ["engine_data"]}``):
    ``prompt_token_ids``, ``completion_token_ids`` and ``completion_logprobs``; or None. It describes
    one generation, so it is read for the first choice only."""
    if index:
        return None
    return _three_field_source(
        response,
        _DYNAMO_FIELDS,
        "dynamo",
        "Dynamo's engine_data must have all three (is the backend old, or were log probabilities not requested?)",
        index,
    )


_DYNAMO_FIELDS = (
    "nvext.engine_data.prompt_token_ids",
    "nvext.engine_data.completion_token_ids",
    "nvext.engine_data.completion_logprobs",
)


def extract_sglang(response: DecodedResponse, index: int = 0) -> Candidate | None:
    """SGLang's inline ids (``return_token_ids``): ``choices[index].prompt_token_ids`` and
    ``choices[index].token_ids``, log probabilities from ``choices[index].logprobs.content``; or None."""
    choice = f"choices[{index}]"
    if not response.present(f"{choice}.prompt_token_ids"):
        return None
    prompt = response.token_ids(f"{choice}.prompt_token_ids")
    generation = response.token_ids(f"{choice}.token_ids")
    routed = _routed_experts(response, index)
    if generation is None:
        problem: TokenCaptureError = PartialTokenMetadataError(
            f"the response has SGLang inline {choice}.prompt_token_ids but no {choice}.token_ids; "
            "SGLang sends both with return_token_ids=true"
        )
        return Candidate("sglang", prompt, None, None, problem, routed)
    entries = response.logprob_entries(index)
    if entries is None:
        return _without_log_probs("sglang", "SGLang", choice, prompt, generation, routed)
    log_probs = [entry.logprob for entry in entries]
    _lengths_match(generation, log_probs, f"{choice}.token_ids", f"{choice}.logprobs.content")
    return Candidate("sglang", prompt, generation, log_probs, None, routed)


_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "required_prefix_token_ids",
)


def tokenize_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body: exactly the prompt-affecting fields present in the request."""
    return {name: request[name] for name in _TOKENIZE_FIELDS if name in request}


class MessageBundleSource(PureSource):
    """A complete bundle on ``choices[0].message`` (source ``message``)."""

    extract = staticmethod(extract_message_bundle)


class DynamoSource(PureSource):
    """NVIDIA Dynamo's ``nvext.engine_data`` (source ``dynamo``)."""

    extract = staticmethod(extract_dynamo)


class SGLangSource(PureSource):
    """SGLang's inline ids on the choice (source ``sglang``)."""

    extract = staticmethod(extract_sglang)


class VLLMInlineSource(PureSource):
    """vLLM inline ids with logprobs (source ``vllm``)."""

    extract = staticmethod(extract_vllm_inline)


class LogprobsSource(TokenMiddleware):
    """Generation ids and log probabilities from ``choices[i].logprobs.content``; the prompt ids from
    ``/tokenize`` (source ``tokenize``), called only when no source before it found a bundle.

    When an earlier source found the bundle, the logprob tokens are a cross-check of its
    generation ids (skipped when the server wrote tokens as text rather than ``token_id:<int>``).
    """

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        response, index = exchange.response, exchange.index
        if exchange.found is not None:
            entries = response.logprob_entries(index)
            if entries is not None and _id_tokens(entries):  # text tokens: nothing to compare ids with
                ids, log_probs = response.logprob_tokens(index) or ([], [])
                exchange.offer(Candidate("logprobs", None, ids, log_probs))
            return await self.inner(exchange)
        from_logprobs = response.logprob_tokens(index)
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
            exchange.offer(Candidate("tokenize", prompt, ids, log_probs, None, _routed_experts(response, index)))
        return await self.inner(exchange)


def check_usage(usage: Any, bundle: TokenBundle, generated: int | None, what: str = "ids") -> None:
    """``usage.prompt_tokens`` must equal the bundle's prompt length and, when ``generated`` is given,
    ``usage.completion_tokens`` must equal it (``what`` says what was counted)."""
    if not isinstance(usage, dict):
        return
    checks = [("prompt_tokens", len(bundle.prompt_token_ids), "ids")]
    if generated is not None:
        checks.append(("completion_tokens", generated, what))
    for key, length, counted in checks:
        count = usage.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count != length:
            raise ConflictingTokenMetadataError(
                f"usage.{key} is {count} but the {bundle.source!r} source has {length} {counted}; the server's "
                "accounting and its token lists disagree"
            )


def check_choice_count(request: Mapping[str, Any], count: int) -> None:
    """A request that named ``n`` gets exactly ``n`` choices (a GRPO group of the wrong size is a
    silent wrong answer); ``ChoiceCountError`` otherwise."""
    n = request.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and count != n:
        raise ChoiceCountError(
            f"the request asked for n={n} choices but the response has {count}; a group of another size "
            "cannot be trained on as asked (is the server ignoring n, or did a proxy cut the response?)",
            requested=n,
            received=count,
        )


class UsageCheck(TokenMiddleware):
    """After extraction: ``usage.prompt_tokens``, when present, must equal each choice's prompt
    length, and ``usage.completion_tokens`` the generated ids of all choices together (checked at
    the last choice); ``ConflictingTokenMetadataError`` otherwise."""

    async def __call__(self, exchange: Exchange) -> TokenBundle:
        bundle = await self.inner(exchange)
        last = exchange.index == len(exchange.response.choices) - 1
        generated = len(bundle.generation_token_ids) + sum(len(b.generation_token_ids) for b in exchange.group)
        what = "ids" if exchange.index == 0 else f"generated ids over {exchange.index + 1} choices"
        check_usage(exchange.response.body.get("usage"), bundle, generated if last else None, what)
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
    VLLMResponsesSource,
    LogprobsSource,
)


def build_chain(entries: Sequence[ChainEntry] = DEFAULT_CHAIN, inner: Handler = require_bundle) -> Handler:
    """Build the chain around ``inner``; the first entry is the outermost (highest precedence)."""
    handler = inner
    for entry in reversed(entries):
        handler = entry(handler)
    return handler
