"""The `chat` and `feed` sub-commands: flags, environment, exit codes.

The one place where the client reads flags and environment variables
(STREAMCHAT_API_KEY, XDG_STATE_HOME, TERM). Heavy modules (websockets,
prompt_toolkit, rich) are imported only when a command runs, so `--help`
is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from . import DEFAULT_URL

EXIT_ERROR, EXIT_INTERRUPTED = 1, 130


def add_commands(subparsers: Any) -> None:
    """Adds `chat` and `feed` to an argparse subparsers object."""
    chat = subparsers.add_parser(
        "chat", help="talk with the daemon in a terminal",
        description="A chat REPL: replies stream as they are written; /? lists the commands.")
    chat.add_argument("url", nargs="?", default=DEFAULT_URL,
                      help=f"the daemon's websocket URL (default {DEFAULT_URL})")
    chat.add_argument("--system", metavar="TEXT", help="system instructions for a new session")
    chat.add_argument("--resume", metavar="ID",
                      help="attach to a known session (an id prefix is enough)")
    chat.add_argument("--plain", action="store_true",
                      help="print plain text, no Markdown or colours")
    _add_common(chat)
    chat.set_defaults(func=chat_command)

    feed = subparsers.add_parser(
        "feed", help="stream a text source into a session",
        usage="%(prog)s [URL] [FILE|-] (--session ID | --new) [options]",
        description="Streams a file, or standard input as it arrives, into a session: one "
                    "append per line, a commit at blank lines or after --commit-idle seconds.")
    feed.add_argument("inputs", nargs="*", metavar="[URL] [FILE|-]", action=_UrlAndSource,
                      help=f"the daemon's URL (default {DEFAULT_URL}) and the text to feed "
                           "(default -, standard input)")
    target = feed.add_mutually_exclusive_group(required=True)
    target.add_argument("--session", metavar="ID", help="feed into this session")
    target.add_argument("--new", action="store_true", help="feed into a new session; prints its id")
    feed.add_argument("--resume-token", metavar="TOKEN",
                      help="the session's resume token, if the session file lacks it")
    feed.add_argument("--system", metavar="TEXT", help="set the session's system instructions")
    feed.add_argument("--commit-idle", metavar="SECONDS", type=_positive_float, default=3.0,
                      help="commit the open item after this long without input (default 3)")
    feed.add_argument("--ask", metavar="QUESTION", help="at the end, ask this and print the answer")
    feed.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    _add_common(feed)
    feed.set_defaults(func=feed_command)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m streamchat.client chat|feed ...`."""
    parser = argparse.ArgumentParser(prog="streamchat", description="The streamchat client.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def chat_command(args: argparse.Namespace) -> int:
    from .chat import ChatConfig, ChatSession
    from .render import make_ui
    from .repl import Repl

    env = os.environ
    store, state = _store(env)
    config = ChatConfig(_endpoint(args, env), system=args.system, resume=args.resume,
                        options=_reply_options(args))
    terminal = sys.stdin.isatty() and sys.stdout.isatty()
    plain = args.plain or not sys.stdout.isatty() or env.get("TERM", "") in ("", "dumb", "unknown")
    repl = Repl(ChatSession(config, store), make_ui(plain), _reader(terminal, state))
    return _run(repl.run(), args.verbose)


def feed_command(args: argparse.Namespace) -> int:
    from .feed import FeedConfig, run_feed

    env = os.environ
    store, _ = _store(env)
    url, source = args.inputs
    config = FeedConfig(_endpoint(args, env, url), session=args.session,
                        resume_token=args.resume_token, system=args.system, source=source,
                        commit_idle_s=args.commit_idle, ask=args.ask,
                        options=_reply_options(args), quiet=args.quiet)
    return _run(run_feed(config, store), args.verbose)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", metavar="KEY",
                        help="sent as Authorization: Bearer KEY (default $STREAMCHAT_API_KEY)")
    parser.add_argument("--max-tokens", metavar="N", type=_positive_int, help="limit each reply")
    parser.add_argument("--temperature", metavar="X", type=_non_negative_float,
                        help="sampling temperature (0 is greedy)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every event to stderr")


class _UrlAndSource(argparse.Action):
    """[URL] [FILE|-]: a first value that looks like ws:// or wss:// is the URL."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        values = list(values or [])
        url = values.pop(0) if values and values[0].startswith(("ws://", "wss://")) else DEFAULT_URL
        if len(values) > 1:
            raise argparse.ArgumentError(self, f"expected [URL] [FILE|-], got {' '.join(values)}")
        setattr(namespace, self.dest, (url, values[0] if values else "-"))


def _run(coro: Any, verbose: bool) -> int:
    import asyncio
    import logging

    from .errors import ClientError

    from .controls import EscapingFormatter, escape_controls

    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    try:
        return asyncio.run(coro)
    except ClientError as exc:
        print(f"streamchat: {escape_controls(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def _endpoint(args: argparse.Namespace, env: Mapping[str, str], url: str | None = None):
    from .connection import Endpoint

    key = args.api_key or env.get("STREAMCHAT_API_KEY") or None
    return Endpoint(url or args.url, key)


def _store(env: Mapping[str, str]):
    from .sessions import FILE_NAME, SessionStore, state_dir

    state = state_dir(env)
    return SessionStore(state / FILE_NAME), state


def _reader(terminal: bool, state):
    from .prompt import StreamInput, TerminalInput
    from .sessions import private_file

    if not terminal:
        return StreamInput(sys.stdin)
    try:
        history = private_file(state / "history")
    except OSError:
        history = None  # an unwritable state directory costs the history, nothing else
    return TerminalInput(history)


def _reply_options(args: argparse.Namespace) -> dict:
    options: dict = {}
    if args.max_tokens is not None:
        options["max_output_tokens"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    return options


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text}")
    return value
