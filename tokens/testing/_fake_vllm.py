"""A fake vLLM 0.32 OpenAI-compatible server for tests: one handler for respx and ``httpx.MockTransport``.

It tokenizes with a small deterministic byte tokenizer and a chat template of its own, and serves
``/v1/chat/completions`` (inline ids, logprobs, ``n``, ``stream``, tools), ``/v1/completions``
(text or token-id prompts, ``stream``), ``/tokenize`` and ``/detokenize`` consistently with each other. Its
bodies have exactly the field sets of real vLLM 0.32 answers (checked against recorded ones), and
its errors are vLLM's (context length, ``max_tokens``, bad request; 429 and 503 with Retry-After).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar

import httpx

__all__ = ["FakeTokenizer", "FakeVLLM"]

SYSTEM_FINGERPRINT = "vllm-0.32.0-fake"
TOOL_CALL = "<tool_call>\n{}\n</tool_call>"


class FakeTokenizer:
    """Bytes as ids (id = byte + 3) and three special tokens: 0 ``<pad>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``.

    The chat template: each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (tools, when
    given, as a system message listing their JSON first), then ``<|im_start|>assistant\\n``.
    """

    PAD, IM_START, IM_END = 0, 1, 2
    OFFSET = 3
    VOCAB_SIZE = OFFSET + 256
    SPECIAL: ClassVar[Mapping[int, str]] = {0: "<pad>", 1: "<|im_start|>", 2: "<|im_end|>"}

    def encode(self, text: str) -> list[int]:
        return [byte + self.OFFSET for byte in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for token in ids:
            out += self.SPECIAL[token].encode() if token in self.SPECIAL else bytes([token - self.OFFSET])
        return out.decode("utf-8", "replace")

    def token_bytes(self, token: int) -> list[int]:
        return list(self.SPECIAL[token].encode()) if token in self.SPECIAL else [token - self.OFFSET]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        ids: list[int] = []
        turns = list(messages)
        if tools:
            turns.insert(0, {"role": "system", "content": "tools: " + json.dumps(list(tools), sort_keys=True)})
        for message in turns:
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            ids += [self.IM_START, *self.encode(f"{message.get('role')}\n{text}"), self.IM_END, *self.encode("\n")]
        if add_generation_prompt:
            ids += [self.IM_START, *self.encode("assistant\n")]
        return ids


@dataclass(frozen=True)
class _Fault:
    status: int
    retry_after: float | None
    message: str = "The server is busy; retry later"


@dataclass(frozen=True)
class _Tokens:
    """A scripted generation given as ids (and optionally their log probabilities)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None


ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
"""vLLM's error ``type`` by status (any other status: the HTTP reason phrase, as one word, + ``Error``)."""


@dataclass
class FakeVLLM:
    """A fake vLLM server: ``respx_mock.route(host=...).mock(side_effect=fake)`` or
    ``httpx.MockTransport(fake)``.

    ``replies`` are scripted answer texts, used in order (then the default: a deterministic text
    from the prompt, the seed and the choice index); ``reply_tool_call``, ``reply_tokens`` and
    ``reply_error`` script the other kinds of answer in the same queue. ``fail_next(status,
    retry_after)`` makes the very next requests answer 429 or 503, ahead of the queue. ``requests``
    keeps every request body received, by path.
    """

    model: str = "tiny"
    max_model_len: int = 2048
    replies: Sequence[str] = ()
    default_max_tokens: int = 16
    """The generation limit of a request that names none (vLLM's is the rest of the context)."""
    reasoning_parser: bool = False
    """A generation's leading ``<think>...</think>`` becomes the message's ``reasoning`` (vLLM's
    ``--reasoning-parser``), streamed as ``reasoning`` deltas."""
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    requests: list[tuple[str, Any]] = field(default_factory=list)
    _script: deque[str | _Tokens | _Fault] = field(default_factory=deque, repr=False)
    _faults: deque[_Fault] = field(default_factory=deque, repr=False)
    _ids: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        self._script.extend(self.replies)

    def reply(self, *texts: str) -> None:
        """Script the next answers' texts (one per choice or completion, in order)."""
        self._script.extend(texts)

    def reply_tool_call(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Script the next chat answer as a call of tool ``name``: generated as Hermes' ``<tool_call>``
        text, returned parsed as vLLM's ``hermes`` tool parser does (``message.tool_calls``, no content,
        finish reason ``tool_calls``), and streamed as its ``tool_calls`` deltas. Not compared with a
        recording (none has a tool call)."""
        self._script.append(TOOL_CALL.format(json.dumps({"name": name, "arguments": dict(arguments)})))

    def reply_tokens(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Script the next generation as these ids (of ``FakeTokenizer``'s vocabulary), sent as given (no
        end-of-turn token added) with these log probabilities (else the fake's own)."""
        ids = tuple(token_ids)
        if not all(type(t) is int and 0 <= t < FakeTokenizer.VOCAB_SIZE for t in ids):
            raise ValueError(f"token ids must be ints from 0 to {FakeTokenizer.VOCAB_SIZE - 1} (the fake's vocabulary)")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} log probabilities for {len(ids)} token ids: give one per id")
        self._script.append(_Tokens(ids, None if logprobs is None else tuple(float(lp) for lp in logprobs)))

    def reply_error(self, status: int, message: str | None = None, *, retry_after: float | None = None) -> None:
        """Script the chat or completions request whose turn it is (after the replies scripted before)
        to be answered with HTTP ``status`` (400 to 599) in vLLM's error body."""
        if not 400 <= status <= 599:
            raise ValueError(f"an error status is from 400 to 599, not {status}")
        self._script.append(_Fault(status, retry_after, message or _reason(status)))

    def fail_next(self, status: int = 503, *, retry_after: float | None = 1.0, times: int = 1) -> None:
        """The next ``times`` requests get ``status`` (429 or 503) with ``Retry-After``."""
        self._faults.extend(_Fault(status, retry_after) for _ in range(times))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        try:
            body = json.loads(request.content or b"null")
        except ValueError:
            return _error(400, "Invalid JSON in the request body", "BadRequestError")
        self.requests.append((path, body))
        if self._faults:
            fault = self._faults.popleft()
            return _fault(fault)
        if request.method == "GET" and path.endswith("/v1/models"):
            model = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm"}
            return httpx.Response(200, json={"object": "list", "data": [model]})
        routes = {
            "/v1/chat/completions": self._chat,
            "/v1/completions": self._completions,
            "/tokenize": self._tokenize,
            "/detokenize": self._detokenize,
        }
        handler = routes.get(path)
        if handler is None or request.method != "POST":
            return httpx.Response(404, json={"detail": "Not Found"})
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object", "BadRequestError")
        scripted = self._script[0] if self._script else None
        if isinstance(scripted, _Fault) and path.startswith("/v1/"):  # a scripted error: a generation's turn
            self._script.popleft()
            return _fault(scripted)
        return handler(body)

    # -- endpoints --------------------------------------------------------------------------

    def _tokenize(self, body: dict[str, Any]) -> httpx.Response:
        if "messages" in body:
            ids = self.tokenizer.apply_chat_template(
                body["messages"], body.get("tools"), body.get("add_generation_prompt", True)
            )
        else:
            ids = self.tokenizer.encode(str(body.get("prompt", "")))
        return httpx.Response(
            200, json={"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        )

    def _detokenize(self, body: dict[str, Any]) -> httpx.Response:
        tokens = body.get("tokens")
        vocabulary = range(self.tokenizer.VOCAB_SIZE)
        if not isinstance(tokens, list) or not all(type(t) is int and t in vocabulary for t in tokens):
            return _error(
                400,
                f"'tokens' must be a list of ids below {self.tokenizer.VOCAB_SIZE}",
                "BadRequestError",
                param="tokens",
            )
        return httpx.Response(200, json={"prompt": self.tokenizer.decode(tokens)})

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list", "BadRequestError", param="messages")
        prompt = self.tokenizer.apply_chat_template(messages, body.get("tools"))
        problem = self._check_lengths(prompt, body)
        if problem is not None:
            return problem
        choices = self._generate(prompt, body)
        inline = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        want_logprobs = bool(body.get("logprobs"))
        if body.get("stream"):
            return self._stream(prompt, choices, inline, as_ids, want_logprobs, body)
        answer = {
            "id": f"chatcmpl-fake{next(self._ids):012x}", "object": "chat.completion", "created": 1795957000,
            "model": self.model,
            "choices": [
                {"index": index, "message": _message(self.tokenizer.decode(_text_ids(ids)), index,
                                                     reasoning=self.reasoning_parser),
                 "logprobs": {"content": [self._entry(t, lp, as_ids) for t, lp in zip(ids, lps, strict=True)]}
                 if want_logprobs else None,
                 "finish_reason": "tool_calls" if self._calls(ids) and reason == "stop" else reason,
                 "stop_reason": None, "token_ids": ids if inline else None, "routed_experts": None}
                for index, (ids, lps, reason) in enumerate(choices)
            ],
            "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": _usage(len(prompt), sum(len(ids) for ids, _, _ in choices)),
            "prompt_logprobs": None, "prompt_token_ids": prompt if inline else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }  # fmt: skip
        return httpx.Response(200, json=answer)

    def _completions(self, body: dict[str, Any]) -> httpx.Response:
        given = body.get("prompt")
        if isinstance(given, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in given):
            outside = [i for i in given if not 0 <= i < self.tokenizer.VOCAB_SIZE]
            if outside:
                return _error(400, f"Token id {outside[0]} is out of vocabulary", "BadRequestError", param="prompt")
            prompt = list(given)
        elif isinstance(given, str):
            prompt = self.tokenizer.encode(given)
        else:
            return _error(400, "'prompt' must be a string or a list of token ids", "BadRequestError", param="prompt")
        problem = self._check_lengths(prompt, body)
        if problem is not None:
            return problem
        inline = bool(body.get("return_token_ids"))
        want_logprobs = body.get("logprobs") is not None
        choices = []
        generated = self._generate(prompt, body)
        if body.get("stream"):
            return self._completion_stream(prompt, generated, inline, want_logprobs, body)
        for index, (ids, lps, reason) in enumerate(generated):
            pieces = [self.tokenizer.decode([t]) for t in ids]
            offsets = list(itertools.accumulate([0, *map(len, pieces[:-1])])) if pieces else []
            choices.append({
                "index": index, "text": "".join(pieces),
                "logprobs": {"text_offset": offsets, "token_logprobs": lps, "tokens": pieces,
                             "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps, strict=True)]}
                if want_logprobs else None,
                "finish_reason": reason, "stop_reason": None, "token_ids": ids if inline else None,
                "prompt_logprobs": None, "prompt_token_ids": prompt if inline else None, "routed_experts": None,
            })  # fmt: skip
        answer = {
            "id": f"cmpl-fake{next(self._ids):012x}", "object": "text_completion", "created": 1795979193,
            "model": self.model, "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": _usage(len(prompt), sum(len(ids) for ids, _, _ in generated)),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }  # fmt: skip
        return httpx.Response(200, json=answer)

    def _completion_stream(
        self,
        prompt: list[int],
        generated: list[tuple[list[int], list[float], str]],
        inline: bool,
        want_logprobs: bool,
        body: Mapping[str, Any],
    ) -> httpx.Response:
        """vLLM's legacy completion stream: a chunk per token and choice (the prompt ids on each
        choice's first), then the usage chunk when asked, then ``[DONE]``."""
        head = {"id": f"cmpl-fake{next(self._ids):012x}", "object": "text_completion", "created": 1795979193,
                "model": self.model}  # fmt: skip
        events: list[dict[str, Any]] = []
        offsets = [0] * len(generated)
        for position in range(max(len(ids) for ids, _, _ in generated)):  # the choices interleaved, as vLLM's
            for index, (ids, lps, reason) in enumerate(generated):
                if position >= len(ids):
                    continue
                token, logprob = ids[position], lps[position]
                piece = self.tokenizer.decode([token])
                logprobs = {"text_offset": [offsets[index]], "token_logprobs": [logprob], "tokens": [piece],
                            "top_logprobs": [{piece: logprob}]}  # fmt: skip
                offsets[index] += len(piece)
                events.append({**head, "choices": [{
                    "index": index, "text": piece, "logprobs": logprobs if want_logprobs else None,
                    "finish_reason": reason if position == len(ids) - 1 else None, "stop_reason": None,
                    "prompt_token_ids": prompt if inline and position == 0 else None,
                    "token_ids": [token] if inline else None,
                }]})  # fmt: skip
        return self._event_stream(events, head, len(prompt), sum(len(ids) for ids, _, _ in generated), body)

    def _event_stream(
        self,
        events: list[dict[str, Any]],
        head: Mapping[str, Any],
        prompt: int,
        generated: int,
        body: Mapping[str, Any],
    ) -> httpx.Response:
        """``events`` as server-sent events, the usage chunk after them when asked, then ``[DONE]``."""
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage = _usage(prompt, generated, details=False)
            events.append({**head, "choices": [], "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT})
        data = b"".join(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n" for event in events)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=data + b"data: [DONE]\n\n"
        )

    # -- generation -------------------------------------------------------------------------

    def _check_lengths(self, prompt: list[int], body: Mapping[str, Any]) -> httpx.Response | None:
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or self.default_max_tokens
        if max_tokens > self.max_model_len:
            return _error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                param="max_tokens",
            )
        if len(prompt) + 1 > self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt contains at least {len(prompt)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(prompt)})",
                "BadRequestError",
                param="input_tokens",
            )
        return None

    def _generate(self, prompt: list[int], body: Mapping[str, Any]) -> list[tuple[list[int], list[float], str]]:
        """Per choice: generated ids, their log probabilities and the finish reason (deterministic)."""
        n = body.get("n") or 1
        max_tokens = min(
            body.get("max_tokens") or body.get("max_completion_tokens") or self.default_max_tokens,
            self.max_model_len - len(prompt),
        )
        seed = body.get("seed") or 0
        out = []
        for index in range(n):
            scripted = self._script[0] if self._script else None
            if isinstance(scripted, _Fault | None):  # an error answers a request of its own
                digest = hashlib.sha256(f"{prompt}|{seed}|{index}".encode()).hexdigest()
                scripted = " ".join(digest[i : i + 4] for i in range(0, 16, 4))
            else:
                self._script.popleft()
            given = None
            if isinstance(scripted, _Tokens):
                ids, given = list(scripted.ids), scripted.logprobs
            else:
                ids = [*self.tokenizer.encode(scripted), FakeTokenizer.IM_END]
            reason = "stop" if len(ids) <= max_tokens else "length"
            ids = ids[:max_tokens]
            lps = (
                list(given[: len(ids)])
                if given is not None
                else [
                    -((token * 7919 + position * 104729 + index) % 997) / 100.0 - 0.01
                    for position, token in enumerate(ids)
                ]
            )
            out.append((ids, lps, reason))
        return out

    def _calls(self, ids: Sequence[int]) -> bool:
        """Whether a generation is parsed as a tool call (after its reasoning, with the reasoning parser)."""
        text = self.tokenizer.decode(_text_ids(ids))
        return _tool_call(_split_reasoning(text)[1] if self.reasoning_parser else text) is not None

    def _entry(self, token: int, logprob: float, as_ids: bool) -> dict[str, Any]:
        text = f"token_id:{token}" if as_ids else self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": self.tokenizer.token_bytes(token), "top_logprobs": []}

    def _stream(
        self,
        prompt: list[int],
        choices: list[tuple[list[int], list[float], str]],
        inline: bool,
        as_ids: bool,
        want_logprobs: bool,
        body: Mapping[str, Any],
    ) -> httpx.Response:
        ident = f"chatcmpl-fake{next(self._ids):012x}"
        head = {"id": ident, "object": "chat.completion.chunk", "created": 1795979193, "model": self.model}
        events = []
        first: dict[str, Any] = {
            **head,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(choices))
            ],
        }
        if inline:
            first.update(prompt_token_ids=prompt, prompt_text=None)
        events.append(first)
        for index, (ids, lps, reason) in enumerate(choices):
            deltas = _stream_deltas(self.tokenizer, ids, index, self.reasoning_parser)
            if self._calls(ids) and reason == "stop":
                reason = "tool_calls"
            for position, (token, logprob) in enumerate(zip(ids, lps, strict=True)):
                last = position == len(ids) - 1
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": self.tokenizer.decode(_text_ids([token]))} if deltas is None
                    else deltas[position],
                    "logprobs": {"content": [self._entry(token, logprob, as_ids)]} if want_logprobs else None,
                    "finish_reason": reason if last else None,
                }  # fmt: skip
                if last:
                    choice["stop_reason"] = None
                if inline:
                    choice["token_ids"] = [token]
                events.append({**head, "choices": [choice]})
        return self._event_stream(events, head, len(prompt), sum(len(c[0]) for c in choices), body)


def _text_ids(ids: Sequence[int]) -> list[int]:
    """The ids that are text (the end-of-turn token is not part of the message content)."""
    return [token for token in ids if token not in FakeTokenizer.SPECIAL]


def _stream_deltas(
    tokenizer: FakeTokenizer, ids: Sequence[int], index: int, reasoning: bool
) -> list[dict[str, Any]] | None:
    """A generation streamed as vLLM's parsers stream it, one delta per token: with ``reasoning`` (the
    reasoning parser), a leading ``<think>`` block's text as ``reasoning`` deltas; a tool call (all of
    the rest) as the hermes parser's ``tool_calls`` deltas, its id and name with its first token and
    its arguments spread over the others; other text as ``content``; nothing for the tags and the
    end-of-turn token. None for a plain text (each token its own content)."""
    text = tokenizer.decode(_text_ids(ids))
    thought, rest = _split_reasoning(text) if reasoning else (None, text)
    call = _tool_call(rest)
    if thought is None and call is None:
        return None
    start, end, tail = len(THINK), len(THINK) + len(thought or ""), len(text) - len(rest)
    if thought is None:
        start = end = 0
    spans = []
    position = 0
    for token in ids:
        low, position = position, position + len(tokenizer.decode(_text_ids([token])))
        spans.append((low, position))
    in_call = [n for n, (low, high) in enumerate(spans) if low >= tail and high > low]
    arguments = json.dumps(call.get("arguments", {})) if call is not None else ""
    deltas: list[dict[str, Any]] = []
    for n, (low, high) in enumerate(spans):
        delta: dict[str, Any] = {}
        if text[max(low, start) : min(high, end)]:
            delta["reasoning"] = text[max(low, start) : min(high, end)]
        if call is None and high > tail:
            delta["content"] = text[max(low, tail) : high]
        elif call is not None and n in in_call:
            k = in_call.index(n)
            if k == 0:
                head = {"index": 0, "id": f"chatcmpl-tool-fake{index:08x}", "type": "function"}
                delta["tool_calls"] = [{**head, "function": {"name": call["name"], "arguments": ""}}]
            else:
                rest_count = len(in_call) - 1
                piece = arguments[(k - 1) * len(arguments) // rest_count : k * len(arguments) // rest_count]
                if piece:
                    delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece}}]
        deltas.append(delta)
    return deltas


THINK, END_THINK = "<think>", "</think>"


def _split_reasoning(text: str) -> tuple[str | None, str]:
    """A text's leading ``<think>...</think>`` (its reasoning) and the rest; None without one."""
    if not text.startswith(THINK) or END_THINK not in text:
        return None, text
    reasoning, _, rest = text[len(THINK) :].partition(END_THINK)
    return reasoning, rest.lstrip("\n")


def _tool_call(text: str) -> dict[str, Any] | None:
    """The call in a complete ``<tool_call>`` text, else None."""
    prefix, suffix = TOOL_CALL.split("{}")
    if not (text.startswith(prefix) and text.endswith(suffix)):
        return None
    try:
        call = json.loads(text[len(prefix) : -len(suffix)])
    except ValueError:
        return None
    return call if isinstance(call, dict) and "name" in call else None


def _message(content: str, index: int = 0, *, reasoning: bool = False) -> dict[str, Any]:
    thought, content = _split_reasoning(content) if reasoning else (None, content)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": thought,
    }
    call = _tool_call(content)
    if call is not None:
        function = {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}
        message.update(
            content=None,
            tool_calls=[{"id": f"chatcmpl-tool-fake{index:08x}", "type": "function", "function": function}],
        )
    return message


def _usage(prompt: int, completion: int, *, details: bool = True) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return usage


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


def _fault(fault: _Fault) -> httpx.Response:
    headers = {} if fault.retry_after is None else {"retry-after": f"{fault.retry_after:g}"}
    kind = ERROR_TYPES.get(fault.status) or _reason(fault.status).title().replace(" ", "").replace("-", "") + "Error"
    return _error(fault.status, fault.message, kind, headers=headers)


def _error(
    status: int, message: str, kind: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    return httpx.Response(
        status, headers=headers, json={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )
