"""Token capture: every extraction, validation and transport rule, on real vLLM response shapes."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import respx
import stamina

import tokens
from tests.retry_probe import count_retry_contexts
from tests.token_samples import BASE, CHAT, INLINE, LOGPROBS_ONLY, TOKENIZE, TOKENIZED, sample
from tokens import TokenBundle, TokenClient, UnsupportedRequestError
from tokens.chain import DEFAULT_CHAIN, DecodedResponse, Exchange, VLLMInlineSource, decode_response, require_bundle

pytestmark = pytest.mark.anyio

REQUEST = sample("chat_inline_ids.request")
USER_BODY = {
    k: v
    for k, v in REQUEST.items()
    if k not in ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "return_token_ids")
}


def message_bundle_response() -> dict[str, Any]:
    """The inline sample reshaped as NeMo RL attaches a bundle: on the message, no inline fields."""
    response = copy.deepcopy(LOGPROBS_ONLY)
    message = response["choices"][0]["message"]
    message["prompt_token_ids"] = list(INLINE["prompt_token_ids"])
    message["generation_token_ids"] = list(INLINE["choices"][0]["token_ids"])
    message["generation_log_probs"] = [e["logprob"] for e in INLINE["choices"][0]["logprobs"]["content"]]
    del response["choices"][0]["logprobs"]
    return response


@pytest.fixture(autouse=True)
def no_sleeping() -> Iterator[None]:
    with stamina.set_testing(True, attempts=3, cap=True):
        yield


@pytest.fixture
def server() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


@dataclass
class Completed:
    response: dict[str, Any]
    bundle: TokenBundle
    calls: tuple[int, int]
    """(chat completion requests, /tokenize requests)"""


async def complete(response: dict[str, Any] | bytes, *, token_ids: bool = True, **body: Any) -> Completed:
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=token_ids) as client:
        with respx.mock(assert_all_called=False) as router:
            chat = router.post(CHAT).mock(
                return_value=httpx.Response(
                    200,
                    content=response if isinstance(response, bytes) else None,
                    json=None if isinstance(response, bytes) else response,
                )
            )
            tokenize = router.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
            completion = await client.chat_completion(**(body or USER_BODY))
            return Completed(completion.response, completion.bundle, (chat.call_count, tokenize.call_count))


# -- each source alone ---------------------------------------------------------------------


async def test_vllm_inline_ids_alone() -> None:
    """Inline ids give the bundle in one request, with log probabilities from logprobs."""
    completion = await complete(INLINE)
    bundle = completion.bundle
    assert bundle.source == "vllm"
    assert bundle.prompt_token_ids == INLINE["prompt_token_ids"]
    assert bundle.generation_token_ids == INLINE["choices"][0]["token_ids"]
    assert bundle.generation_log_probs == [e["logprob"] for e in INLINE["choices"][0]["logprobs"]["content"]]
    assert completion.calls == (1, 0)


async def test_logprobs_with_tokenize_fallback_alone() -> None:
    """Without inline ids, generation comes from logprobs and the prompt from /tokenize."""
    completion = await complete(LOGPROBS_ONLY, token_ids=False)
    bundle = completion.bundle
    assert bundle.source == "tokenize"
    assert bundle.prompt_token_ids == TOKENIZED["tokens"]
    assert bundle.generation_token_ids == [
        int(e["token"].split(":")[1]) for e in LOGPROBS_ONLY["choices"][0]["logprobs"]["content"]
    ]
    assert completion.calls == (1, 1)


async def test_message_bundle_alone() -> None:
    """A complete bundle already on the message is taken as it is."""
    completion = await complete(message_bundle_response())
    assert completion.bundle.source == "message"
    assert completion.bundle.prompt_token_ids == INLINE["prompt_token_ids"]
    assert completion.calls == (1, 0)


# -- the response that comes back ----------------------------------------------------------


async def test_response_keeps_fields_and_drops_transport() -> None:
    """The bundle sits on the message; top-level prompt ids, token_ids and logprobs are gone; the rest stays."""
    completion = await complete(INLINE)
    response = completion.response
    assert "prompt_token_ids" not in response
    choice = response["choices"][0]
    assert "token_ids" not in choice and "logprobs" not in choice
    assert choice["message"]["prompt_token_ids"] is completion.bundle.prompt_token_ids
    assert choice["message"]["generation_token_ids"] is completion.bundle.generation_token_ids
    assert choice["message"]["generation_log_probs"] is completion.bundle.generation_log_probs
    for key in set(INLINE) - {"prompt_token_ids", "choices"}:
        assert response[key] == INLINE[key]
    for key in set(INLINE["choices"][0]) - {"token_ids", "logprobs", "message"}:
        assert choice[key] == INLINE["choices"][0][key]
    for key, value in INLINE["choices"][0]["message"].items():
        assert choice["message"][key] == value


@pytest.mark.parametrize("routed", [[[[1, 2], [3, 4]], [[5, 6], [7, 8]]], "opaque-base64-blob=="])
async def test_routed_experts_pass_through(routed: Any) -> None:
    """routed_experts, nested lists or an opaque string, moves to the message unchanged."""
    response = copy.deepcopy(INLINE)
    response["choices"][0]["routed_experts"] = routed
    completion = await complete(response)
    assert completion.bundle.routed_experts == routed
    assert completion.response["choices"][0]["message"]["routed_experts"] == routed
    assert "routed_experts" not in completion.response["choices"][0]


# -- precedence and agreement --------------------------------------------------------------


async def test_message_bundle_wins_and_agrees_with_inline() -> None:
    """With a message bundle and matching inline ids, the message is the source and no conflict is raised."""
    response = message_bundle_response()
    response["prompt_token_ids"] = INLINE["prompt_token_ids"]
    response["choices"][0]["token_ids"] = INLINE["choices"][0]["token_ids"]
    response["choices"][0]["logprobs"] = INLINE["choices"][0]["logprobs"]
    completion = await complete(response)
    assert completion.bundle.source == "message"
    assert completion.calls == (1, 0)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.update(prompt_token_ids=[*r["prompt_token_ids"][:-1], 7]), "prompt_token_ids"),
        (lambda r: r["choices"][0].update(token_ids=[*r["choices"][0]["token_ids"][:-1], 7]), "generation"),
    ],
)
async def test_message_and_inline_conflict(mutate: Any, field: str) -> None:
    """A message bundle and inline ids that differ raise tokens.ConflictingTokenMetadataError naming the field."""
    response = message_bundle_response()
    response["prompt_token_ids"] = list(INLINE["prompt_token_ids"])
    response["choices"][0]["token_ids"] = list(INLINE["choices"][0]["token_ids"])
    response["choices"][0]["logprobs"] = copy.deepcopy(INLINE["choices"][0]["logprobs"])
    response["choices"][0]["logprobs"]["content"][-1]["token"] = "token_id:7"
    if field == "prompt_token_ids":
        response["choices"][0]["logprobs"] = copy.deepcopy(INLINE["choices"][0]["logprobs"])
    mutate(response)
    with pytest.raises(tokens.ConflictingTokenMetadataError, match="disagree"):
        await complete(response)


async def test_lower_source_without_log_probabilities_is_cross_checked_not_required() -> None:
    """A complete message bundle beside vLLM inline ids with no logprobs (return_token_ids with
    logprobs=false, through a proxy that adds the bundle) is accepted: the inline ids are checked
    against the bundle and their missing log probabilities are not an error, since they did not win."""
    response = message_bundle_response()
    response["prompt_token_ids"] = list(INLINE["prompt_token_ids"])
    response["choices"][0]["token_ids"] = list(INLINE["choices"][0]["token_ids"])
    completion = await complete(response)
    assert completion.bundle.source == "message"
    assert completion.bundle.generation_token_ids == INLINE["choices"][0]["token_ids"]
    response["choices"][0]["token_ids"][3] += 1
    with pytest.raises(
        tokens.ConflictingTokenMetadataError, match=r"'message' source and the 'vllm' source .* at index 3"
    ):
        await complete(response)


async def test_lower_partial_source_is_checked_on_what_it_carries() -> None:
    """Inline prompt ids alone (no choice.token_ids) below a message bundle: compared, not an error."""
    response = message_bundle_response()
    response["prompt_token_ids"] = list(INLINE["prompt_token_ids"])
    assert (await complete(response)).bundle.source == "message"
    response["prompt_token_ids"][0] += 1
    with pytest.raises(tokens.ConflictingTokenMetadataError, match=r"prompt_token_ids: .* at index 0"):
        await complete(response)


async def test_incomplete_winning_source_is_an_error() -> None:
    """Inline ids that win (no bundle on the message) but lack log probabilities: tokens.MissingTokenMetadataError."""
    response = copy.deepcopy(INLINE)
    del response["choices"][0]["logprobs"]
    with pytest.raises(tokens.MissingTokenMetadataError, match=r"inline ids but no choices\[0\]\.logprobs\.content"):
        await complete(response)


async def test_inline_ids_must_equal_logprob_ids() -> None:
    """choice.token_ids that differ from the logprob tokens are a conflict, at the first differing index."""
    response = copy.deepcopy(INLINE)
    response["choices"][0]["token_ids"][2] += 1
    with pytest.raises(tokens.ConflictingTokenMetadataError, match="at index 2"):
        await complete(response)


async def test_message_bundle_must_match_logprobs() -> None:
    """A message bundle whose generation differs from logprobs present beside it is a conflict."""
    response = message_bundle_response()
    response["choices"][0]["logprobs"] = copy.deepcopy(INLINE["choices"][0]["logprobs"])
    response["choices"][0]["logprobs"]["content"][0]["token"] = "token_id:9"
    with pytest.raises(tokens.ConflictingTokenMetadataError, match="at index 0"):
        await complete(response)


# -- partial, malformed, missing -----------------------------------------------------------


@pytest.mark.parametrize("drop", ["prompt_token_ids", "generation_token_ids", "generation_log_probs"])
async def test_partial_message_bundle(drop: str) -> None:
    """A message with some but not all bundle fields is partial, naming what is missing."""
    response = message_bundle_response()
    del response["choices"][0]["message"][drop]
    with pytest.raises(tokens.PartialTokenMetadataError, match=f"but not choices\\[0\\].message.{drop}"):
        await complete(response)


async def test_partial_inline_ids() -> None:
    """prompt_token_ids without choice.token_ids, or the reverse, is partial."""
    response = copy.deepcopy(INLINE)
    response["choices"][0]["token_ids"] = None
    with pytest.raises(tokens.PartialTokenMetadataError, match=r"no choices\[0\]\.token_ids"):
        await complete(response)
    response = copy.deepcopy(INLINE)
    del response["prompt_token_ids"]
    with pytest.raises(tokens.PartialTokenMetadataError, match="no prompt_token_ids"):
        await complete(response)


def _set(path: str, value: Any) -> Any:
    def mutate(response: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = response
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value

    return mutate


MALFORMED = [
    ("prompt_token_ids", _set("prompt_token_ids", "1 2 3"), "prompt_token_ids: Expected `array \\| null`, got `str`"),
    ("bool id", _set("prompt_token_ids/3", True), r"prompt_token_ids\[3\]: Expected `int`, got `bool`"),
    ("negative id", _set("choices/0/token_ids/1", -4), r"choices\[0\].token_ids\[1\]"),
    ("float id", _set("choices/0/token_ids/1", 4.0), r"choices\[0\].token_ids\[1\]: Expected `int`, got `float`"),
    ("entry not object", _set("choices/0/logprobs/content/2", "token_id:5"), r"content\[2\]: Expected `object`"),
    ("bad token", _set("choices/0/logprobs/content/4/token", "hello"), r"content\[4\].token: 'hello' is not"),
    ("bool logprob", _set("choices/0/logprobs/content/1/logprob", False), r"content\[1\].logprob: Expected `float`"),
    ("string logprob", _set("choices/0/logprobs/content/1/logprob", "-1.5"), r"content\[1\].logprob"),
    ("content not list", _set("choices/0/logprobs/content", {"a": 1}), r"logprobs.content: Expected `array"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), MALFORMED, ids=[c[0] for c in MALFORMED])
async def test_malformed_inline(case: str, mutate: Any, message: str) -> None:
    """Each wrong shape raises tokens.MalformedTokenMetadataError naming the field and index."""
    response = copy.deepcopy(INLINE)
    mutate(response)
    with pytest.raises(tokens.MalformedTokenMetadataError, match=message):
        await complete(response)


async def test_length_mismatch_is_malformed() -> None:
    """Generation ids and log probabilities of different lengths are malformed."""
    response = copy.deepcopy(INLINE)
    response["choices"][0]["token_ids"].append(5)
    with pytest.raises(tokens.MalformedTokenMetadataError, match=r"7 ids but choices\[0\]\.logprobs\.content has 6"):
        await complete(response)
    response = message_bundle_response()
    response["choices"][0]["message"]["generation_log_probs"].pop()
    with pytest.raises(tokens.MalformedTokenMetadataError, match="must pair one to one"):
        await complete(response)


async def test_missing_everything() -> None:
    """No logprobs and no other source is tokens.MissingTokenMetadataError."""
    response = copy.deepcopy(LOGPROBS_ONLY)
    response["choices"][0]["logprobs"] = None
    with pytest.raises(tokens.MissingTokenMetadataError, match="no token source"):
        await complete(response, token_ids=False)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"{}", "no 'choices'"),
        (b'{"choices": []}', "empty"),
        (b'{"choices": [1]}', "list of objects"),
    ],
)
async def test_malformed_envelope(body: bytes, error: str) -> None:
    """A body that is not a chat completion is tokens.MalformedResponseError saying why."""
    with pytest.raises(tokens.MalformedResponseError, match=error):
        await complete(body)


# -- requests -------------------------------------------------------------------------------


async def test_exact_tokenize_body(server: respx.MockRouter) -> None:
    """/tokenize receives exactly the prompt-affecting fields present in the request."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    tokenize = server.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
    body = {
        **USER_BODY,
        "chat_template_kwargs": {"enable_thinking": False},
        "mm_processor_kwargs": {"fps": 1},
        "required_prefix_token_ids": [2, 608],
        "temperature": 0.7,
    }
    async with TokenClient(BASE) as client:
        await client.chat_completion(**body)
    assert chat.call_count == 1
    assert json.loads(tokenize.calls.last.request.content) == {
        "model": "tiny",
        "messages": REQUEST["messages"],
        "tools": REQUEST["tools"],
        "chat_template_kwargs": {"enable_thinking": False},
        "mm_processor_kwargs": {"fps": 1},
        "required_prefix_token_ids": [2, 608],
    }


@pytest.mark.parametrize("top_logprobs", [None, 5, "absent"])
@pytest.mark.parametrize("token_ids", [True, False])
async def test_request_knobs_forced(server: respx.MockRouter, top_logprobs: Any, token_ids: bool) -> None:
    """logprobs, top_logprobs=0 and return_tokens_as_token_ids are forced; return_token_ids only when asked."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    body = {**USER_BODY, "logprobs": False, "prompt_logprobs": 3}
    if top_logprobs != "absent":
        body["top_logprobs"] = top_logprobs
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=token_ids) as client:
        await client.chat_completion(**body)
    sent = json.loads(chat.calls.last.request.content)
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0 and sent["return_tokens_as_token_ids"] is True
    assert "prompt_logprobs" not in sent
    assert sent.get("return_token_ids") is (True if token_ids else None)
    assert sent["messages"] == REQUEST["messages"] and sent["max_tokens"] == REQUEST["max_tokens"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [({"n": 0}, "n=0"), ({"n": True}, "n=True"), ({"n": "2"}, "n='2'"), ({"stream": True}, "stream")],
)
async def test_unsupported_requests_send_nothing(server: respx.MockRouter, extra: dict[str, Any], match: str) -> None:
    """An n that is not a positive int, and streaming, are refused before any request."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    async with TokenClient(BASE) as client:
        with pytest.raises(UnsupportedRequestError, match=match):
            await client.chat_completion(**USER_BODY, **extra)
    assert chat.call_count == 0


@pytest.mark.parametrize(
    "base", ["http://vllm.test:8000/v1", "http://vllm.test:8000/v1/", "http://vllm.test:8000", "http://vllm.test:8000/"]
)
async def test_base_urls(server: respx.MockRouter, base: str) -> None:
    """Completions go to {base_url}/chat/completions and /tokenize to the server root, slash or not."""
    chat_url = base.rstrip("/") + "/chat/completions"
    chat = server.post(chat_url).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    tokenize = server.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
    async with TokenClient(base) as client:
        completion = await client.chat_completion(**USER_BODY)
    assert chat.call_count == 1 and tokenize.call_count == 1
    assert completion.bundle.prompt_token_ids == TOKENIZED["tokens"]


# -- HTTP errors and retries ----------------------------------------------------------------


async def refused_with_400(server: respx.MockRouter, answer: str, error: type[Exception], match: str) -> Any:
    """The error a call answered by the recorded 400 ``answer`` raises: ``error``, with its status and body,
    after one request (never retried)."""
    body = sample(answer)
    chat = server.post(CHAT).mock(return_value=httpx.Response(400, json=body))
    async with TokenClient(BASE) as client:
        with pytest.raises(error, match=match) as info:
            await client.chat_completion(**USER_BODY)
    assert getattr(info.value, "status_code", None) == 400 and getattr(info.value, "body", None) == body
    assert chat.call_count == 1
    return info.value


async def test_context_length_error(server: respx.MockRouter) -> None:
    """vLLM's context-length 400 becomes ContextLengthExceededError with its message, not retried."""
    await refused_with_400(
        server, "error_context_length.response", tokens.ContextLengthExceededError, "maximum context length is 2048"
    )


async def test_other_400_keeps_status_and_body(server: respx.MockRouter) -> None:
    """Another 400 is a ServerResponseError with status and body, not a context-length error, not retried."""
    error = await refused_with_400(server, "error_max_tokens.response", tokens.ServerResponseError, "max_tokens=5000")
    assert not isinstance(error, tokens.ContextLengthExceededError)


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_transient_statuses_are_retried(server: respx.MockRouter, status: int) -> None:
    """A transient status is retried and the next success is used."""
    chat = server.post(CHAT).mock(side_effect=[httpx.Response(status, text="busy"), httpx.Response(200, json=INLINE)])
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as client:
        completion = await client.chat_completion(**USER_BODY)
    assert chat.call_count == 2 and completion.bundle.source == "vllm"


async def test_connection_errors_retried_and_bounded(server: respx.MockRouter) -> None:
    """Connection errors are retried up to the policy's attempts, then propagate."""
    chat = server.post(CHAT).mock(side_effect=httpx.ConnectError("refused"))
    async with TokenClient(BASE) as client:
        with pytest.raises(httpx.ConnectError):
            await client.chat_completion(**USER_BODY)
    assert chat.call_count == 3
    tokenize = server.post(TOKENIZE).mock(side_effect=[httpx.ReadError("reset"), httpx.Response(200, json=TOKENIZED)])
    chat.mock(side_effect=None, return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    async with TokenClient(BASE) as client:
        completion = await client.chat_completion(**USER_BODY)
    assert tokenize.call_count == 2 and completion.bundle.source == "tokenize"


async def test_a_call_that_succeeds_sets_up_no_retry_context(
    server: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retries cost nothing until something fails: stamina is entered only after a first failure, and
    then the attempts are the policy's (the first one included)."""
    entered = count_retry_contexts(monkeypatch)
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as client:
        await client.chat_completion(**USER_BODY)
        assert entered == [] and chat.call_count == 1
        chat.mock(side_effect=[httpx.Response(503, text="busy")] * 3)
        with pytest.raises(tokens.ServerResponseError) as info:
            await client.chat_completion(**USER_BODY)
    assert entered == [1] and chat.call_count == 1 + 3 and info.value.status_code == 503


async def test_retry_after_is_honoured(server: respx.MockRouter) -> None:
    """A 429's Retry-After sets the wait (real sleeping here, with a tiny hint)."""
    chat = server.post(CHAT).mock(
        side_effect=[httpx.Response(429, headers={"Retry-After": "0.05"}), httpx.Response(200, json=INLINE)]
    )
    waits: list[float] = []

    class Recorder:
        def __call__(self, details: Any) -> None:
            waits.append(details.wait_for)

    with stamina.set_testing(False):
        stamina.instrumentation.set_on_retry_hooks([Recorder()])
        try:
            async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as client:
                await client.chat_completion(**USER_BODY)
        finally:
            stamina.instrumentation.set_on_retry_hooks(None)
    assert chat.call_count == 2
    assert len(waits) == 1 and 0.05 <= waits[0] < 1.0


async def test_chain_step_with_plain_inner_handler() -> None:
    """A chain step is testable with a plain async function as its inner handler."""
    seen: list[TokenBundle | None] = []

    async def inner(exchange: Exchange) -> TokenBundle:
        seen.append(exchange.found)
        return await require_bundle(exchange)

    step = VLLMInlineSource(inner)
    response: DecodedResponse = decode_response(json.dumps(INLINE))
    bundle = await step(Exchange(REQUEST, response))
    assert seen == [bundle] and bundle.source == "vllm"
    no_source = {**LOGPROBS_ONLY, "choices": [{**LOGPROBS_ONLY["choices"][0], "logprobs": None}]}
    with pytest.raises(tokens.MissingTokenMetadataError):
        await step(Exchange(REQUEST, decode_response(json.dumps(no_source))))
    assert seen[-1] is None


async def test_api_key_is_sent_as_bearer_to_both_endpoints(server: respx.MockRouter) -> None:
    """The API key reaches the completion and the /tokenize fallback as a bearer token."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    tokenize = server.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
    async with TokenClient(BASE, api_key="sk-test") as client:
        await client.chat_completion(**USER_BODY)
    assert chat.calls.last.request.headers["Authorization"] == "Bearer sk-test"
    assert tokenize.calls.last.request.headers["Authorization"] == "Bearer sk-test"


async def test_timeouts_of_own_and_injected_clients(server: respx.MockRouter) -> None:
    """A client made here allows long generations; an injected client keeps its own timeout unless one is given."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    async with TokenClient(BASE, request_prompt_and_generation_token_ids=True) as client:
        await client.chat_completion(**USER_BODY)
    assert chat.calls.last.request.extensions["timeout"]["read"] == 600.0
    async with httpx.AsyncClient(timeout=7.0) as http:
        async with TokenClient(BASE, http_client=http, request_prompt_and_generation_token_ids=True) as client:
            await client.chat_completion(**USER_BODY)
        assert chat.calls.last.request.extensions["timeout"]["read"] == 7.0
        async with TokenClient(BASE, http_client=http, timeout=30, request_prompt_and_generation_token_ids=True) as c:
            await c.chat_completion(**USER_BODY)
        assert chat.calls.last.request.extensions["timeout"]["read"] == 30
        assert not http.is_closed


@pytest.mark.parametrize("order", ["default", "reversed sources"])
async def test_cross_checks_do_not_depend_on_the_chain_order(order: str) -> None:
    """Chain sources in either order find the same conflict (no step relies on a flag another set)."""
    response = message_bundle_response()
    response["prompt_token_ids"] = list(INLINE["prompt_token_ids"])
    response["choices"][0]["token_ids"] = list(INLINE["choices"][0]["token_ids"])
    response["choices"][0]["logprobs"] = copy.deepcopy(INLINE["choices"][0]["logprobs"])
    response["choices"][0]["logprobs"]["content"][1]["token"] = "token_id:5"
    chain = list(DEFAULT_CHAIN)
    if order != "default":
        chain = [*chain[:2], *reversed(chain[2:-1]), chain[-1]]  # the /tokenize fallback stays last
    async with TokenClient(BASE, middleware=chain) as client:
        with pytest.raises(tokens.ConflictingTokenMetadataError, match="at index 1"):
            await client.extract(REQUEST, json.dumps(response))
        response["choices"][0]["logprobs"]["content"][1]["token"] = f"token_id:{INLINE['choices'][0]['token_ids'][1]}"
        completion = await client.extract(REQUEST, json.dumps(response))
    assert completion.bundle.generation_token_ids == INLINE["choices"][0]["token_ids"]
