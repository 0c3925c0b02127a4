"""Token-in completions: ``/v1/completions`` with the prompt given as token ids.

Continuing a multi-turn trajectory by sending ids (``Trajectory.required_prefix_token_ids`` plus
the next turn's) avoids re-tokenizing history. The server echoes the prompt ids
(``return_token_ids``); they must equal what was sent, or ``ConflictingTokenMetadataError`` says
where they differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ._bundle import TokenBundle, TokenCompletion, WeightVersionSpan
from ._chain import check_choice_count, check_usage
from ._decode import DecodedResponse, decode_response, token_ids_of
from ._errors import (
    ConflictingTokenMetadataError,
    MalformedResponseError,
    MalformedTokenMetadataError,
    MissingTokenMetadataError,
)
from ._exchange import describe_difference

__all__ = ["extract_generate", "extract_token_in", "prepare_generate", "prepare_token_in"]


def _check_ids(prompt_token_ids: list[int]) -> None:
    if not isinstance(prompt_token_ids, list) or not all(type(i) is int and i >= 0 for i in prompt_token_ids):
        raise ValueError("prompt_token_ids must be a list of non-negative ints")


def prepare_token_in(prompt_token_ids: list[int], body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` request: the ids as the prompt, ids and log probabilities asked back."""
    _check_ids(prompt_token_ids)
    sent = {key: value for key, value in body.items() if key not in ("prompt", "echo", "stream")}
    sent.update(prompt=prompt_token_ids, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True)
    return sent


def _choice_bundle(response: DecodedResponse, index: int, sent: list[int] | None) -> TokenBundle:
    """A choice's bundle; ``sent``: the prompt ids given, which the server's must equal (None for a
    text prompt: the server's ids are the prompt's)."""
    choice = f"choices[{index}]"
    prompt = response.token_ids(f"{choice}.prompt_token_ids")
    generation = response.token_ids(f"{choice}.token_ids")
    logprobs = response.completion_logprobs(index)
    if prompt is None or generation is None or logprobs is None:
        raise MissingTokenMetadataError(
            f"{choice}: the completion lacks prompt_token_ids, token_ids or logprobs; the server must honour "
            "return_token_ids=true and logprobs=0 (vLLM does)"
        )
    if sent is None:
        sent = prompt
    elif prompt != sent:
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
    """The bundles of a completion (one per choice), checked against the ids sent (a text prompt: the
    server's own prompt ids)."""
    given = request["prompt"]
    ids = isinstance(given, list) and all(type(token) is int for token in given)
    sent: list[int] | None = given if ids else None
    response = decode_response(data)
    check_choice_count(request, len(response.choices))
    bundles = tuple(_choice_bundle(response, index, sent) for index in range(len(response.choices)))
    check_usage(
        response.body.get("usage"), bundles[0], sum(len(b.generation_token_ids) for b in bundles), "generated ids"
    )
    for choice, bundle in zip(response.choices, bundles, strict=True):
        choice["prompt_token_ids"] = bundle.prompt_token_ids
        choice["generation_token_ids"] = bundle.generation_token_ids
        choice["generation_log_probs"] = bundle.generation_log_probs
    return TokenCompletion(response.body, bundles)


def prepare_generate(prompt_token_ids: list[int], body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request (vLLM ``--enable-scale-out``): ``token_ids`` in, the
    prompt echoed and one log probability per sampled token asked back. ``body`` holds
    ``sampling_params`` (``max_tokens``, ``temperature``, ...) and any other field of the endpoint."""
    _check_ids(prompt_token_ids)
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must hold at least one id for /inference/v1/generate")
    params = body.get("sampling_params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"sampling_params must be a mapping, not {type(params).__name__}")
    sent = {key: value for key, value in body.items() if key not in ("token_ids", "stream", "output_mode")}
    sent.update(token_ids=prompt_token_ids, return_token_ids=True, sampling_params={**params, "logprobs": 0})
    return sent


def _spans(value: Any, where: str, length: int) -> tuple[WeightVersionSpan, ...]:
    """vLLM's ``weight_versions``: contiguous ``[start, end)`` spans covering the generation."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise MalformedTokenMetadataError(f"{where}: weight_versions must be a list of spans, not {value!r:.80}")
    spans: list[WeightVersionSpan] = []
    position = 0
    for span in value:
        if not (
            isinstance(span, dict)
            and isinstance(span.get("version"), str)
            and type(span.get("start")) is int
            and type(span.get("end")) is int
            and span["start"] == position
            and span["end"] > span["start"]
        ):
            raise MalformedTokenMetadataError(
                f"{where}: weight_versions span {span!r:.80} is not "
                f"{{version, start={position}, end>start}}; spans must tile the "
                "generation in order"
            )
        spans.append(WeightVersionSpan(span["version"], span["start"], span["end"]))
        position = span["end"]
    if spans and position != length:
        raise MalformedTokenMetadataError(f"{where}: weight_versions cover {position} of {length} generated tokens")
    return tuple(spans)


def _generate_bundle(choice: Any, index: int, sent: list[int]) -> TokenBundle:
    where = f"choices[{index}]"
    if not isinstance(choice, dict):
        raise MalformedTokenMetadataError(f"{where} is not an object")
    generation = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(generation, list) or not isinstance(content, list):
        raise MissingTokenMetadataError(
            f"{where}: the answer lacks token_ids or logprobs.content; the server must "
            "honour sampling_params.logprobs=0 (vLLM's /inference/v1/generate does)"
        )
    if len(content) != len(generation):
        raise MalformedTokenMetadataError(f"{where}: {len(generation)} token_ids but {len(content)} logprobs")
    log_probs: list[float] = []
    for position, (token, entry) in enumerate(zip(generation, content, strict=True)):
        if not (
            isinstance(entry, dict)
            and entry.get("token_id") == token
            and type(token) is int
            and token >= 0
            and isinstance(entry.get("logprob"), int | float)
            and not isinstance(entry.get("logprob"), bool)
        ):
            raise MalformedTokenMetadataError(
                f"{where}.logprobs.content[{position}]: {entry!r:.80} is not the log probability of token {token!r}"
            )
        log_probs.append(float(entry["logprob"]))
    spans = _spans(choice.get("weight_versions"), where, len(generation))
    return TokenBundle(sent, generation, log_probs, "vllm", weight_versions=spans)


def extract_generate(request: Mapping[str, Any], data: bytes | str) -> TokenCompletion:
    """The bundles of an ``/inference/v1/generate`` answer, with each choice's weight-version spans;
    the echoed prompt must equal the ids sent."""
    sent: list[int] = request["token_ids"]
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise MalformedResponseError(f"/inference/v1/generate: the answer is not JSON ({exc})") from None
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        raise MalformedResponseError("/inference/v1/generate: the answer has no choices list; is this vLLM's endpoint?")
    params = request.get("sampling_params")
    check_choice_count(params if isinstance(params, Mapping) else {}, len(choices))
    echoed = body.get("prompt_token_ids")
    if echoed is not None and echoed != sent:
        raise ConflictingTokenMetadataError(
            f"prompt_token_ids: the server's prompt differs from the ids sent "
            f"{describe_difference(sent, echoed)}; it did not use the prompt given"
        )
    bundles = tuple(_generate_bundle(choice, index, sent) for index, choice in enumerate(choices))
    for choice, bundle in zip(choices, bundles, strict=True):
        choice["prompt_token_ids"] = bundle.prompt_token_ids
        choice["generation_token_ids"] = bundle.generation_token_ids
        choice["generation_log_probs"] = bundle.generation_log_probs
    return TokenCompletion(body, bundles)
