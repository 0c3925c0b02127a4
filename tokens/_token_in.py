"""Token-in completions: ``/v1/completions`` with the prompt given as token ids.

Continuing a multi-turn trajectory by sending ids (``Trajectory.required_prefix_token_ids`` plus
the next turn's) avoids re-tokenizing history. The server echoes the prompt ids
(``return_token_ids``); they must equal what was sent, or ``ConflictingTokenMetadataError`` says
where they differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._bundle import TokenBundle, TokenCompletion
from ._chain import check_choice_count, check_usage, describe_difference
from ._decode import DecodedResponse, decode_response, token_ids_of
from ._errors import ConflictingTokenMetadataError, MalformedTokenMetadataError, MissingTokenMetadataError

__all__ = ["extract_token_in", "prepare_token_in"]


def prepare_token_in(prompt_token_ids: list[int], body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` request: the ids as the prompt, ids and log probabilities asked back."""
    if not isinstance(prompt_token_ids, list) or not all(
        type(i) is int and i >= 0 for i in prompt_token_ids
    ):  # fmt: skip
        raise ValueError("prompt_token_ids must be a list of non-negative ints")
    sent = {key: value for key, value in body.items() if key not in ("prompt", "echo", "stream")}
    sent.update(prompt=prompt_token_ids, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True)
    return sent


def _choice_bundle(response: DecodedResponse, index: int, sent: list[int]) -> TokenBundle:
    choice = f"choices[{index}]"
    prompt = response.token_ids(f"{choice}.prompt_token_ids")
    generation = response.token_ids(f"{choice}.token_ids")
    logprobs = response.completion_logprobs(index)
    if prompt is None or generation is None or logprobs is None:
        raise MissingTokenMetadataError(
            f"{choice}: the completion lacks prompt_token_ids, token_ids or logprobs; the server must honour "
            "return_token_ids=true and logprobs=0 (vLLM does)"
        )
    if prompt != sent:
        raise ConflictingTokenMetadataError(
            f"{choice}.prompt_token_ids: the server's prompt differs from the ids sent "
            f"{describe_difference(sent, prompt)}; it did not use the prompt given"
        )
    tokens, log_probs = logprobs
    if len(tokens) != len(generation) or len(log_probs) != len(generation):
        raise MalformedTokenMetadataError(
            f"{choice}: {len(generation)} token_ids but {len(tokens)} logprobs.tokens and {len(log_probs)} "
            "logprobs.token_logprobs; they must pair one to one"
        )
    if tokens and tokens[0].startswith("token_id:"):
        ids = token_ids_of(tokens, f"{choice}.logprobs.tokens[{{}}]")
        if ids != generation:
            raise ConflictingTokenMetadataError(
                f"{choice}.token_ids and {choice}.logprobs.tokens disagree {describe_difference(generation, ids)}"
            )
    return TokenBundle(sent, generation, log_probs, "vllm")


def extract_token_in(request: Mapping[str, Any], data: bytes | str) -> TokenCompletion:
    """The bundles of a token-in completion (one per choice), checked against the ids sent."""
    sent: list[int] = request["prompt"]
    response = decode_response(data)
    check_choice_count(request, len(response.choices))
    bundles = tuple(_choice_bundle(response, index, sent) for index in range(len(response.choices)))
    check_usage(response.body.get("usage"), bundles[0], sum(len(b.generation_token_ids) for b in bundles),
                "generated ids")  # fmt: skip
    for choice, bundle in zip(response.choices, bundles, strict=True):
        choice["prompt_token_ids"] = bundle.prompt_token_ids
        choice["generation_token_ids"] = bundle.generation_token_ids
        choice["generation_log_probs"] = bundle.generation_log_probs
    return TokenCompletion(response.body, bundles)
