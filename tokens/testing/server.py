"""python -m tokens.testing.server: serve the fake vLLM of tokens.testing on a port, as an
OpenAI-compatible HTTP server, for trying the token examples, a TokenClient, the openai SDK or the
capture proxy on a machine without a GPU. Its base URL (http://127.0.0.1:8000/v1 by default) is
printed on one line once it listens; Ctrl-C or SIGTERM stops it. It is not vLLM: its tokenizer
(bytes as ids) and chat template are its own.

Replies come, in order, from --script FILE and then from the reply options, in the order given;
when they are used up, the fake answers with texts of its own.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ._errors import ScriptError
from ._script import MAX_STREAM_DELAY_S, Script, add_reply, read_script
from ._server import bind

__all__ = ["main"]

PROGRAM = "python -m tokens.testing.server"
SCRIPT_HELP = """\
A script file is a JSON object, every key optional:
  {"model": "tiny", "max_model_len": 2048, "stream_delay_s": 0.05,
   "replies": ["It is noon.",
               {"tool_call": {"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}},
               {"token_ids": [75, 107, 2], "logprobs": [-0.5, -0.25, -0.01]},
               {"error": 503, "message": "busy", "retry_after": 1}]}
A text, tool call or token-ids reply answers the next choice generated; an error answers the next
chat or completions request. Token ids are the fake's: 0 <pad>, 1 <|im_start|>, 2 <|im_end|>,
then each byte + 3.

Exit codes: 0 after Ctrl-C or SIGTERM, 2 for an unusable option or script, 1 when it cannot listen.
"""


class _Reply(argparse.Action):
    """Appends ``(option, value)`` to one list, so that replies of different kinds keep their order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        replies = [*getattr(namespace, self.dest), (option_string, values)]
        setattr(namespace, self.dest, replies)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description=__doc__, epilog=SCRIPT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default: 8000, vLLM's; 0: any free one)")
    parser.add_argument("--script", metavar="FILE", help="a JSON script of replies and settings (below)")
    parser.add_argument("--model", help="the model name /v1/models lists (default: the script's, else tiny)")
    parser.add_argument("--max-model-len", type=int, metavar="N", help="the context length, in tokens (default 2048)")
    parser.add_argument(
        "--stream-delay",
        type=float,
        metavar="SECONDS",
        help="the pause between a stream's events (default: the script's, else 0)",
    )
    parser.add_argument("--log", action="store_true", help="print one line per request on stderr")
    replies = parser.add_argument_group("replies, in order after the script's")
    kinds = {
        "--reply": ("TEXT", "answer a choice with this text"),
        "--tool-call": ("JSON", 'answer a choice with a tool call: \'{"name": "get_time", "arguments": {}}\''),
        "--token-ids": ("IDS", "answer a choice with these ids, comma-separated: 75,107,2"),
        "--error": ("STATUS", "answer a request with this HTTP status (400 to 599)"),
    }
    for option, (metavar, text) in kinds.items():
        replies.add_argument(option, dest="replies", action=_Reply, default=[], metavar=metavar, help=text)
    return parser


def _script(args: argparse.Namespace) -> Script:
    script = read_script(args.script) if args.script else Script()
    if args.model is not None:
        script.fake.model = args.model
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ScriptError(f"--max-model-len must be a positive number of tokens, not {args.max_model_len}")
        script.fake.max_model_len = args.max_model_len
    if args.stream_delay is not None:
        if not 0 <= args.stream_delay <= MAX_STREAM_DELAY_S:
            raise ScriptError(
                f"--stream-delay must be from 0 to {MAX_STREAM_DELAY_S:g} seconds, not {args.stream_delay}"
            )
        script.stream_delay_s = args.stream_delay
    for option, value in args.replies:
        add_reply(script.fake, _reply(option, value), option)
    return script


def _reply(option: str, value: str) -> Any:
    """A command-line reply as the script entry it stands for."""
    if option == "--reply":
        return value
    if option == "--token-ids":
        try:
            return {"token_ids": [int(part) for part in value.split(",")]}
        except ValueError:
            raise ScriptError(f"{option}: {value!r} is not ids separated by commas, such as 75,107,2") from None
    if option == "--error":
        if not value.isdigit():
            raise ScriptError(f"{option}: {value!r} is not an HTTP status such as 503")
        return {"error": int(value)}
    try:
        return {"tool_call": json.loads(value)}
    except ValueError:
        raise ScriptError(
            f'{option}: not JSON; give \'{{"name": "get_time", "arguments": {{"tz": "UTC"}}}}\''
        ) from None


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGINT or SIGTERM (exit 0); 2 for an unusable option or script, 1 when it cannot
    listen on ``--host``/``--port``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port: {args.port} is not a TCP port (0 to 65535; 0: any free one)")
    try:
        script = _script(args)
    except ScriptError as exc:
        print(f"{PROGRAM}: {exc}", file=sys.stderr)
        return 2
    try:
        server = bind(args.host, args.port, script.fake, stream_delay_s=script.stream_delay_s, log=args.log)
    except OSError as exc:
        print(
            f"{PROGRAM}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; pick another --port "
            "(0: any free one) or --host",
            file=sys.stderr,
        )
        return 1
    previous = signal.signal(signal.SIGTERM, _stop)
    previous_int = signal.signal(signal.SIGINT, _stop)  # also where it was ignored (started with & in a script)
    try:
        print(server.url + "/v1", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
