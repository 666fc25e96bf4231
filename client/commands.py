"""Slash commands and multi-line fences of the chat prompt, as pure functions.

`parse_command` turns one input into a `Command` (or None for a message),
`fence_open` says whether Enter should submit, `unfence` removes the
triple-quote fences. Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Union

FENCE = '"""'
Value = Union[str, int, float, None]

HELP = """\
Available commands:
  /set system <text>     set the system instructions (pinned, never evicted)
  /set max_tokens N      limit each reply to N tokens
  /set temperature X     sampling temperature (0 is greedy)
  /set top_p X | top_k N | seed N | min_p X
  /set frequency_penalty X | presence_penalty X    in [-2, 2]; 0 is off
  /set repetition_penalty X                        in (0, 10]; 1 is off
  /show session|system|stats|settings
  /clear                 start a new session with the same instructions
  /regen                 generate another reply to the conversation so far
  /sessions              list the sessions this client knows
  /resume <id>           attach to a known session (an id prefix is enough)
  /read <file>           add a file's text to the conversation, without a reply
  /bye, /exit, /quit     leave (or Ctrl-D)
  /?, /help              this help

Use \"\"\" to begin and end a multi-line message; pasted text keeps its lines.
Ctrl-C stops a reply and keeps what was written; start a line with // to
send a message that begins with /."""

_SETTINGS: dict[str, Callable[[str], Value]] = {
    "max_tokens": lambda s: _positive_int(s),
    "temperature": lambda s: _non_negative_float(s),
    "top_p": lambda s: _unit_float(s),
    "top_k": lambda s: _positive_int(s),
    "seed": lambda s: _int(s),
    "min_p": lambda s: _ranged_float(s, 0.0, 1.0),
    "frequency_penalty": lambda s: _ranged_float(s, -2.0, 2.0),
    "presence_penalty": lambda s: _ranged_float(s, -2.0, 2.0),
    "repetition_penalty": lambda s: _ranged_float(s, 0.0, 10.0, low_open=True),
}
_SHOW = ("session", "system", "stats", "settings")
_ALIASES = {"?": "help", "help": "help", "bye": "bye", "exit": "bye", "quit": "bye",
            "clear": "clear", "regen": "regen", "sessions": "sessions",
            "resume": "resume", "read": "read", "set": "set", "show": "show"}


@dataclass(frozen=True)
class Command:
    """A parsed slash command.

    name: help, bye, set, show, clear, regen, sessions, resume, read.
    key: what `set` sets or `show` shows. value: the new setting, the
    session id of `resume`, the path of `read`.
    """

    name: str
    key: str = ""
    value: Value = None


class CommandError(ValueError):
    """A slash command that cannot be run as typed; the message says why."""


def parse_command(line: str) -> Command | None:
    """The command in `line`, or None when the line is a message to send."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    word, rest = _split_word(text[1:])
    name = _ALIASES.get(word.lower())
    if name is None:
        raise CommandError(f"unknown command /{word}; type /? for help")
    if name == "set":
        return _parse_set(rest)
    if name == "show":
        key = rest.lower()
        if key not in _SHOW:
            raise CommandError("usage: /show " + "|".join(_SHOW))
        return Command("show", key)
    if name in ("resume", "read"):
        if not rest:
            raise CommandError(f"usage: /{name} <{'id' if name == 'resume' else 'file'}>")
        return Command(name, value=rest)
    if rest:
        raise CommandError(f"/{word} takes no argument")
    return Command(name)


def message_text(line: str) -> str:
    """The message a non-command line sends (`//x` sends `/x`)."""
    text = line.strip()
    return text[1:] if text.startswith("//") else text


def fence_open(text: str) -> bool:
    """True while the input holds an unclosed \"\"\" fence (Enter adds a line)."""
    return text.count(FENCE) % 2 == 1


def unfence(text: str) -> str:
    """The input without its \"\"\" fences and the line breaks right inside them."""
    if FENCE not in text:
        return text
    before, _, rest = text.partition(FENCE)
    inner, closing, after = rest.rpartition(FENCE)
    if not closing:  # unclosed at the end of input: the rest is inside
        inner, after = rest, ""
    inner = inner[1:] if inner.startswith("\n") else inner
    inner = inner[:-1] if inner.endswith("\n") else inner
    return before + inner + after


def _split_word(text: str) -> tuple[str, str]:
    """The first word and the rest, which may span lines."""
    match = re.match(r"(\S*)\s*(.*)", text, re.S)
    assert match is not None  # the pattern matches any string
    return match.group(1), match.group(2).strip()


def _parse_set(rest: str) -> Command:
    key, raw = _split_word(rest)
    key = key.lower()
    if key == "system":
        return Command("set", "system", raw)
    convert = _SETTINGS.get(key)
    if convert is None:
        names = " N | /set ".join(_SETTINGS)
        raise CommandError(f"usage: /set system <text> | /set {names} N")
    if not raw:
        raise CommandError(f"usage: /set {key} <value>")
    try:
        return Command("set", key, convert(raw))
    except ValueError as exc:
        raise CommandError(f"/set {key}: {exc}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, not {text}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, not {text}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError(f"must be a positive whole number, not {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"must be a number >= 0, not {text}")
    return value


def _unit_float(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], not {text}")
    return value


def _ranged_float(text: str, low: float, high: float, *, low_open: bool = False) -> float:
    value = _float(text)
    if not ((low < value if low_open else low <= value) and value <= high):
        raise ValueError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], not {text}")
    return value
