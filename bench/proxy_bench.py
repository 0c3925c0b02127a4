"""The capture proxy's memory under hostile clients and a hostile upstream, three processes as deployed.

Run: python bench/proxy_bench.py [--seconds 30] [--clients 64] [--tree PATH]. A hostile upstream (raw
asyncio HTTP: a short captured answer to anything, or for model ``endless`` a stream that never
ends), ``python -m tokens.proxy`` in front of it with bounded options, and this client, which runs
``--clients`` concurrent clients for ``--seconds``: a quarter send bodies just under
``max_request_bytes`` (80,000-odd short messages), a quarter bodies over it, a quarter grow long
``previous_response_id`` chains of 1 MiB turns, and a quarter read endless streams. Prints the
proxy's resident memory when idle and at its peak (VmHWM), the bound docs/proxy.md gives for its
options, and what the clients got. ``--tree`` serves the proxy from another checkout's ``tokens``
(e.g. an export of an earlier commit, to compare); options that tree does not know are left out,
and a proxy past ``--kill-at`` MiB is stopped there (the figure is then a lower bound).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from proxy_stream import started  # bench/ is this script's path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
OPTIONS = {  # the proxy's bounds in this run
    "--max-request-bytes": 8 * MiB,
    "--max-response-bytes": 8 * MiB,
    "--max-requests": 16,
    "--max-rollout-requests": 16,
    "--previous-bytes": 64 * MiB,
    "--queue-timeout": 60,
}
HEAD = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "endless"}
TOKEN = {"token_ids": [1234], "logprobs": {"content": [{"token": "token_id:1234", "logprob": -1.25, "bytes": [32]}]}}
ANSWER = json.dumps(
    {
        **HEAD,
        "object": "chat.completion",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " "}, "finish_reason": "stop", **TOKEN}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
).encode()
FIRST_EVENT = json.dumps(
    {**HEAD, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
)
EVENT = json.dumps({**HEAD, "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None, **TOKEN}]})


# -- the hostile upstream ---------------------------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    events = b"".join(b"data: " + EVENT.encode() + b"\n\n" for _ in range(64))
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            start = await reader.readexactly(min(length, 256))
            left = length - len(start)
            while left:
                left -= len(await reader.read(min(left, 2**20)))
            if b'"model":"endless"' in start:  # a stream that never ends, as fast as it is read
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                writer.write(_chunk(b"data: " + FIRST_EVENT.encode() + b"\n\n"))
                while True:
                    writer.write(_chunk(events))
                    await writer.drain()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
            )
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def serve_upstream() -> None:
    async def run() -> None:
        server = await asyncio.start_server(_answer, "127.0.0.1", 0)
        print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    asyncio.run(run())


# -- the clients ------------------------------------------------------------------------------------


def huge_body(size: int) -> bytes:
    """A chat request of short messages, about ``size`` bytes of JSON."""
    count = size // 64
    messages = [
        {"role": "user" if i % 2 else "assistant", "content": "hello there, hello there!"} for i in range(count)
    ]
    return json.dumps({"model": "canned", "messages": messages}).encode()


async def client(
    kind: str, base: str, until: float, counts: collections.Counter[str], bodies: dict[str, bytes]
) -> None:
    previous: str | None = None
    async with httpx.AsyncClient(timeout=300) as http:
        while time.monotonic() < until:
            try:
                if kind == "endless":
                    request = {"model": "endless", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                    async with http.stream("POST", base + "/chat/completions", json=request) as answer:
                        size = 0
                        async for piece in answer.aiter_raw():
                            size += len(piece)
                    counts[f"{kind} {answer.status_code} {'cut' if b'max_response_bytes' in piece else 'ended'}"] += 1
                    continue
                if kind in ("huge", "oversize"):
                    answer = await http.post(
                        base + "/chat/completions", content=bodies[kind], headers={"content-type": "application/json"}
                    )
                else:
                    request = {"model": "canned", "input": [{"role": "user", "content": "x" * 2**20}]}
                    if previous is not None:
                        request["previous_response_id"] = previous
                    answer = await http.post(base + "/responses", json=request)
                    previous = answer.json().get("id") if answer.status_code == 200 else None
                counts[f"{kind} {answer.status_code}"] += 1
            except httpx.HTTPError as exc:
                counts[f"{kind} {type(exc).__name__}"] += 1


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def bound(options: dict[str, int], idle: int) -> int:
    """docs/proxy.md's bound: idle + max_requests x (8 x max_request_bytes + 3 x max_response_bytes)
    + 2 x previous_bytes (the turns kept, and a chain decoded while it is sent)."""
    per_request = 8 * options["--max-request-bytes"] + 3 * options["--max-response-bytes"]
    return idle + options["--max-requests"] * per_request + 2 * options["--previous-bytes"]


async def run(args: argparse.Namespace, base: str, pid: int) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    bodies = {"huge": huge_body(OPTIONS["--max-request-bytes"] * 95 // 100), "oversize": huge_body(12 * MiB)}
    until = time.monotonic() + args.seconds
    kinds = ("huge", "oversize", "chain", "endless")
    tasks = [
        asyncio.create_task(client(kinds[i % 4], f"{base}/r/bench-{i}/v1", until, counts, bodies))
        for i in range(args.clients)
    ]
    while not all(task.done() for task in tasks):
        await asyncio.sleep(0.2)
        if memory(pid)["VmRSS"] > args.kill_at * MiB:
            os.kill(pid, 9)
            counts["proxy killed at --kill-at"] += 1
            break
    await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose tokens.proxy is measured")
    parser.add_argument("--kill-at", type=int, default=6144, metavar="MIB")
    args = parser.parse_args()
    upstream, upstream_url = started([sys.executable, __file__, "--serve-upstream"], ROOT)
    known = subprocess.run(
        [sys.executable, "-m", "tokens.proxy", "--help"],
        capture_output=True,
        text=True,
        cwd=args.tree,
        env={**os.environ, "PYTHONPATH": str(args.tree)},
    ).stdout
    flags = [str(part) for flag, value in OPTIONS.items() if flag in known for part in (flag, value)]
    command = [sys.executable, "-m", "tokens.proxy", "--upstream", upstream_url + "/v1", "--responses-upstream", "chat"]
    proxy, proxy_url = started([*command, *flags], args.tree)
    try:
        httpx.post(proxy_url + "/v1/chat/completions", json={"model": "canned", "messages": []}, timeout=30)
        idle = memory(proxy.pid)["VmRSS"]
        counts = asyncio.run(run(args, proxy_url, proxy.pid))
        peak = memory(proxy.pid)["VmHWM"] if proxy.poll() is None else args.kill_at * MiB
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=15)
    print(f"proxy from {args.tree}: {args.clients} hostile clients for {args.seconds:g} s, options {' '.join(flags)}")
    print(f"   idle {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (+{(peak - idle) / MiB:.0f} MiB)")
    if len(flags) == 2 * len(OPTIONS):
        print(f"   the documented bound for these options: {bound(OPTIONS, idle) / MiB:.0f} MiB")
    for name, count in sorted(counts.items()):
        print(f"   {name}: {count}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-upstream"]:
        serve_upstream()
    else:
        main()
