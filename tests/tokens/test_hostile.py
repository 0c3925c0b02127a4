"""Token capture against hostile or broken servers and telemetry: typed errors, bounded memory, no leaks."""

from __future__ import annotations

import base64
import copy
import gzip
import json
import logging
import subprocess
import sys
import textwrap
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
import respx
from opentelemetry.metrics import Counter, Histogram, Meter, MeterProvider, NoOpCounter, NoOpHistogram, NoOpMeter
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.trace import StatusCode

from sandbox_middleware.testing.fixtures import TelemetryCapture
from tests.token_samples import BASE, CHAT, INLINE, LOGPROBS_ONLY, TOKENIZE, TOKENIZED
from tokens import MalformedResponseError, ResponseTooLargeError, ServerResponseError, TokenClient
from tokens.chain import MAX_TOKEN_ID

pytestmark = pytest.mark.anyio

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def server() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:
        yield router


async def complete(response: httpx.Response, **options: Any) -> Any:
    async with TokenClient(BASE, retry=None, request_prompt_and_generation_token_ids=True, **options) as client:
        with respx.mock(assert_all_called=False) as router:
            router.post(CHAT).mock(return_value=response)
            return await client.chat_completion(**BODY)


# -- telemetry that raises never reaches the caller ------------------------------------------


class Raising(SpanProcessor):
    def __init__(self, where: str) -> None:
        self.where = where

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        if self.where == "on_start":
            raise RuntimeError("processor broke in on_start")

    def on_end(self, span: ReadableSpan) -> None:
        if self.where == "on_end":
            raise RuntimeError("processor broke in on_end")


class RaisingCounter(NoOpCounter):
    def add(self, amount: int | float, attributes: Any = None, context: Any = None) -> None:
        raise RuntimeError("counter broke")


class RaisingHistogram(NoOpHistogram):
    def record(self, amount: int | float, attributes: Any = None, context: Any = None) -> None:
        raise RuntimeError("histogram broke")


class RaisingMeter(NoOpMeter):
    def create_counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        return RaisingCounter(name)

    def create_histogram(self, name: str, *args: Any, **kwargs: Any) -> Histogram:
        return RaisingHistogram(name)


class RaisingMeterProvider(MeterProvider):
    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> Meter:
        return RaisingMeter(name)


@pytest.mark.parametrize("where", ["on_start", "on_end"])
async def test_raising_span_processor_leaves_completions_intact(where: str, server: respx.MockRouter) -> None:
    """A span processor raising in on_start or on_end: the completion comes back whole, an error keeps its type."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(Raising(where))
    server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    server.post(TOKENIZE).mock(return_value=httpx.Response(200, json=TOKENIZED))
    async with TokenClient(BASE, tracer_provider=tracer_provider, meter_provider=RaisingMeterProvider()) as client:
        completion = await client.chat_completion(**BODY)
        assert completion.bundle.generation_token_ids == INLINE["choices"][0]["token_ids"]
        server.post(CHAT).mock(return_value=httpx.Response(200, content=b"{"))
        with pytest.raises(MalformedResponseError, match="not valid JSON"):
            await client.chat_completion(**BODY)
        server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
        assert (await client.chat_completion(**BODY)).bundle.source == "tokenize"  # the histogram raises too
    tracer_provider.shutdown()


async def test_spans_still_recorded_beside_a_broken_processor(telemetry: TelemetryCapture) -> None:
    """The broken processor does not stop the others: the span ends with its attributes or its error."""
    telemetry.tracer_provider.add_span_processor(Raising("on_end"))
    await complete(httpx.Response(200, json=INLINE), tracer_provider=telemetry.tracer_provider)
    with pytest.raises(MalformedResponseError):
        await complete(httpx.Response(200, content=b"[]"), tracer_provider=telemetry.tracer_provider)
    ok, failed = telemetry.spans("tokens.chat_completion")
    assert ok.attributes is not None and ok.attributes["tokens.source"] == "vllm"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None and failed.attributes["error.type"] == "tokens.MalformedResponseError"


# -- size limits: while reading, after decompression ------------------------------------------


def gzip_bomb(expanded: int) -> bytes:
    """``expanded`` zero bytes, gzip-compressed (about 1,000 to 1)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * 2**20
    return b"".join(compressor.compress(block) for _ in range(expanded // len(block))) + compressor.flush()


async def chunks(data: bytes, size: int = 2**16) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def test_gzip_bomb_is_too_large(server: respx.MockRouter) -> None:
    bomb = gzip_bomb(64 * 2**20)
    assert len(bomb) < 2**20
    response = httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=chunks(bomb))
    with pytest.raises(ResponseTooLargeError, match=r"over max_response_bytes=4,194,304 after decompression") as raised:
        await complete(response, max_response_bytes=4 * 2**20)
    assert raised.value.limit == 4 * 2**20


async def test_oversized_body_is_too_large_while_streaming() -> None:
    """An endless body stops being read at the limit (nothing declares its length)."""
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += 2**16
            yield b" " * 2**16

    with pytest.raises(ResponseTooLargeError, match="the body is larger"):
        await complete(httpx.Response(200, content=endless()), max_response_bytes=2**20)
    assert sent <= 2**20 + 2**16


async def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    body = json.dumps(INLINE).encode()
    with pytest.raises(ResponseTooLargeError, match=f"it declares {len(body):,} bytes"):
        await complete(httpx.Response(200, content=body), max_response_bytes=len(body) - 1)
    assert (await complete(httpx.Response(200, content=body), max_response_bytes=len(body))).bundle.source == "vllm"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw deflate"])
async def test_compressed_bodies_within_the_limit_decode(encoding: str) -> None:
    body = json.dumps(INLINE).encode()
    if encoding == "gzip":
        data = gzip.compress(body)
    else:
        compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS if encoding == "raw deflate" else 15)
        data = compressor.compress(body) + compressor.flush()
    headers = {"Content-Encoding": encoding.split()[-1]}
    completion = await complete(httpx.Response(200, headers=headers, content=chunks(data, 100)))
    assert completion.bundle.prompt_token_ids == INLINE["prompt_token_ids"]


@pytest.mark.parametrize(
    ("headers", "content", "message"),
    [
        ({"Content-Encoding": "br"}, b"x", "Content-Encoding 'br'"),
        ({"Content-Encoding": "gzip"}, b"not gzip at all", "gzip-encoded body does not decompress"),
    ],
)
async def test_bad_encodings_are_malformed(headers: dict[str, str], content: bytes, message: str) -> None:
    with pytest.raises(MalformedResponseError, match=message):
        await complete(httpx.Response(200, headers=headers, content=chunks(content)))


async def test_tokenize_body_is_limited_too(server: respx.MockRouter) -> None:
    server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    bomb = gzip_bomb(8 * 2**20)
    server.post(TOKENIZE).mock(
        return_value=httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=chunks(bomb))
    )
    async with TokenClient(BASE, retry=None, max_response_bytes=2**20) as client:
        with pytest.raises(ResponseTooLargeError, match="/tokenize: the response"):
            await client.chat_completion(**BODY)


def test_bad_limits_are_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_response_bytes must be a positive int"):
            TokenClient(BASE, max_response_bytes=bad)  # type: ignore[arg-type]


MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, zlib
    import anyio, httpx, respx
    from tokens import ResponseTooLargeError, TokenClient

    LIMIT = int(sys.argv[2])
    kind = sys.argv[1]
    if kind == "gzip bomb":  # 1 GiB of zeros in about 1 MiB
        compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        block = bytes(2**20)
        data = b"".join(compressor.compress(block) for _ in range(1024)) + compressor.flush()
        headers = {"Content-Encoding": "gzip"}
    else:  # 512 MiB, streamed, no length declared
        data, headers = None, {}

    async def body():
        if data is not None:
            for start in range(0, len(data), 2**16):
                yield data[start : start + 2**16]
        else:
            for _ in range(512):
                yield b" " * 2**20  # a new object each time, as bytes from a socket are

    def status_mib(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(field)

    def reset_peak():  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")

    async def main():
        before = status_mib("VmRSS")
        reset_peak()
        async with TokenClient("http://vllm.test:8000/v1", retry=None, max_response_bytes=LIMIT) as client:
            with respx.mock() as router:
                router.post("http://vllm.test:8000/v1/chat/completions").mock(
                    return_value=httpx.Response(200, headers=headers, content=body())
                )
                try:
                    await client.chat_completion(model="m", messages=[])
                except ResponseTooLargeError:
                    print("ResponseTooLargeError", before, status_mib("VmHWM"))
                    return
        print("accepted", before, status_mib("VmHWM"))

    anyio.run(main)
    """
)


@pytest.mark.anyio(False)
@pytest.mark.parametrize("kind", ["gzip bomb", "oversized body"])
def test_hostile_bodies_keep_the_client_memory_bounded(kind: str) -> None:
    """Measured in a subprocess (peak RSS, reset just before the request): a 1 GiB gzip bomb and a 512 MiB
    body, each refused at an 8 MiB limit, grow the client's peak memory by a few times the limit, not by
    the body; with a 256 MiB limit the same measure sees the larger read (it can fail)."""

    def growth(limit: int) -> tuple[str, float]:
        result = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, kind, str(limit)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        outcome, before, after = result.stdout.split()
        return outcome, float(after) - float(before)

    outcome, small = growth(8 * 2**20)
    _, large = growth(256 * 2**20)  # the same body with a larger limit: the measure does see memory
    print(f"{kind}: peak RSS grew by {small:.1f} MiB at an 8 MiB limit, {large:.1f} MiB at 256 MiB")
    assert outcome == "ResponseTooLargeError"
    assert small < 40, f"{kind}: peak RSS grew by {small:.1f} MiB for an 8 MiB limit"
    assert large > 200, f"{kind}: the measure missed a 256 MiB read ({large:.1f} MiB)"


# -- malformed bodies are MalformedResponseError ---------------------------------------------


def with_token(index: int, value: Any, token: str | None = None) -> dict[str, Any]:
    response = copy.deepcopy(INLINE)
    response["choices"][0]["token_ids"][index] = value
    response["choices"][0]["logprobs"]["content"][index]["token"] = token if token is not None else f"token_id:{value}"
    return response


DEEP = b'{"choices": [{"message": {"content": "x", "extra": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}]}"
MALFORMED_BODIES: Sequence[tuple[str, bytes, str]] = [
    ("deep nesting", DEEP, "nested too deeply"),
    ("deep nesting, top", b'{"id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
    (
        "deep token field",
        json.dumps({**INLINE, "prompt_token_ids": None})
        .encode()
        .replace(b'"prompt_token_ids": null', b'"prompt_token_ids": ' + b"[" * 50_000 + b"]" * 50_000),
        "nested too deeply",
    ),
    (
        "two ids in one token",
        json.dumps(with_token(0, 5, "token_id:5\ntoken_id:6")).encode(),
        r"content\[0\].token: 'token_id:5\\ntoken_id:6' is not",
    ),
    ("5,000-digit token", json.dumps(with_token(1, 5, "token_id:" + "1" * 5000)).encode(), r"content\[1\].token"),
    (
        "5,000-digit id",
        json.dumps(INLINE).encode().replace(b'"prompt_token_ids": [', b'"prompt_token_ids": [' + b"7" * 5000 + b", "),
        r"prompt_token_ids\[0\]",
    ),
    ("id 10**40", json.dumps(with_token(2, 10**40)).encode(), r"token_ids\[2\].* 0 to 2,147,483,647"),
    ("id 2**31", json.dumps(with_token(2, 2**31)).encode(), r"token_ids\[2\]"),
    ("token id 2**31", json.dumps(with_token(2, 5, f"token_id:{2**31}")).encode(), r"content\[2\].token"),
]


@pytest.mark.parametrize(("case", "body", "message"), MALFORMED_BODIES, ids=[c[0] for c in MALFORMED_BODIES])
async def test_malformed_bodies(case: str, body: bytes, message: str) -> None:
    with pytest.raises(MalformedResponseError, match=message):
        await complete(httpx.Response(200, content=body))


async def test_largest_32_bit_id_is_accepted() -> None:
    completion = await complete(httpx.Response(200, json=with_token(2, MAX_TOKEN_ID)))
    assert completion.bundle.generation_token_ids[2] == MAX_TOKEN_ID


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"tokens": [-7, 1180591620717411303424]}', r"tokens\[0\]"),
        (b'{"tokens": [2147483648]}', r"tokens\[0\]"),
        (b'{"tokens": [1, true]}', r"tokens\[1\]: Expected `int`, got `bool`"),
        (b'{"tokens": "1 2"}', "Expected `array"),
        (b'{"count": 2}', "no 'tokens' list"),
        (b"[1, 2]", "expected an object"),
        (b'{"tokens": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
    ],
)
async def test_tokenize_ids_are_validated(server: respx.MockRouter, body: bytes, message: str) -> None:
    """/tokenize's ids get the same checks as every other source (MalformedTokenMetadataError or the envelope's)."""
    server.post(CHAT).mock(return_value=httpx.Response(200, json=LOGPROBS_ONLY))
    server.post(TOKENIZE).mock(return_value=httpx.Response(200, content=body))
    async with TokenClient(BASE, retry=None) as client:
        with pytest.raises(MalformedResponseError, match=message):
            await client.chat_completion(**BODY)


# -- redirects --------------------------------------------------------------------------------


@pytest.mark.parametrize("follow", [False, True])
async def test_redirect_is_an_error_never_followed(server: respx.MockRouter, follow: bool) -> None:
    """A 302 carrying a completion body is a ServerResponseError (not retried), even from a client set to follow."""
    redirected = server.post(CHAT).mock(
        return_value=httpx.Response(302, headers={"Location": "http://elsewhere.test/v1/chat/completions"}, json=INLINE)
    )
    elsewhere = server.route(host="elsewhere.test").mock(return_value=httpx.Response(200, json=INLINE))
    async with httpx.AsyncClient(follow_redirects=follow) as http, TokenClient(BASE, http_client=http) as client:
        with pytest.raises(ServerResponseError, match=r"HTTP 302 redirect .* to http://elsewhere\.test") as raised:
            await client.chat_completion(**BODY)
    assert raised.value.status_code == 302
    assert redirected.call_count == 1 and elsewhere.call_count == 0


# -- credentials in URLs ----------------------------------------------------------------------

SECRET = "s3cr3t-pw"
CRED_BASE = f"http://alice:{SECRET}@vllm.test:8000/v1"


async def test_url_credentials_become_basic_auth_and_never_leak(
    server: respx.MockRouter, telemetry: TelemetryCapture, caplog: pytest.LogCaptureFixture
) -> None:
    """user:password in base_url is sent as basic auth; no request URL, message, span or log holds the password."""
    chat = server.post(CHAT).mock(return_value=httpx.Response(200, json=INLINE))
    caplog.set_level(logging.DEBUG)
    errors: list[str] = []
    async with TokenClient(
        CRED_BASE, retry=None, tracer_provider=telemetry.tracer_provider, max_response_bytes=2**16
    ) as client:
        assert SECRET not in client.base_url + client.tokenize_url + repr(client)
        await client.chat_completion(**BODY)
        request = chat.calls.last.request
        assert SECRET not in str(request.url)
        assert request.headers["Authorization"] == "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
        for response in (
            httpx.Response(500, text=f"upstream at {CRED_BASE} failed"),
            httpx.Response(302, headers={"Location": f"http://bob:{SECRET}@other.test/"}),
            httpx.Response(200, content=b" " * 2**17),
        ):
            server.post(CHAT).mock(return_value=response)
            with pytest.raises((ServerResponseError, ResponseTooLargeError)) as raised:
                await client.chat_completion(**BODY)
            errors.append(str(raised.value))
    with pytest.raises(ValueError, match="alice:\\*\\*\\*@") as bad:
        TokenClient(f"ftp://alice:{SECRET}@vllm.test/v1")
    assert "bob:***@other.test" in errors[1]
    spans = json.dumps([json.loads(span.to_json()) for span in telemetry.spans()])
    logs = "\n".join(record.getMessage() for record in caplog.records)
    for text in (*errors, str(bad.value), spans, logs):
        assert SECRET not in text
    assert len(telemetry.spans("tokens.chat_completion")) == 4
