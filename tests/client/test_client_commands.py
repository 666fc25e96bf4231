"""Tests of slash-command parsing and multi-line fences, which are pure functions."""

import pytest

from streamchat.client.commands import (
    Command,
    CommandError,
    fence_open,
    message_text,
    parse_command,
    unfence,
)


@pytest.mark.parametrize("line, command", [
    ("/help", Command("help")),
    ("/?", Command("help")),
    ("  /HELP  ", Command("help")),
    ("/bye", Command("bye")),
    ("/exit", Command("bye")),
    ("/quit", Command("bye")),
    ("/set system You are terse.", Command("set", "system", "You are terse.")),
    ("/set system", Command("set", "system", "")),
    ("/set system line one\nline two", Command("set", "system", "line one\nline two")),
    ("/set max_tokens 256", Command("set", "max_tokens", 256)),
    ("/set temperature 0.7", Command("set", "temperature", 0.7)),
    ("/set temperature 0", Command("set", "temperature", 0.0)),
    ("/set top_p 0.9", Command("set", "top_p", 0.9)),
    ("/set seed -3", Command("set", "seed", -3)),
    ("/set min_p 0.05", Command("set", "min_p", 0.05)),
    ("/set min_p 0", Command("set", "min_p", 0.0)),
    ("/set frequency_penalty -2", Command("set", "frequency_penalty", -2.0)),
    ("/set presence_penalty 2", Command("set", "presence_penalty", 2.0)),
    ("/set repetition_penalty 1.1", Command("set", "repetition_penalty", 1.1)),
    ("/set repetition_penalty 10", Command("set", "repetition_penalty", 10.0)),
    ("/show session", Command("show", "session")),
    ("/show system", Command("show", "system")),
    ("/show stats", Command("show", "stats")),
    ("/clear", Command("clear")),
    ("/regen", Command("regen")),
    ("/sessions", Command("sessions")),
    ("/resume sess_abc", Command("resume", value="sess_abc")),
    ("/read ~/notes/a b.txt", Command("read", value="~/notes/a b.txt")),
])
def test_parse_command(line, command):
    """Each command form parses to its Command, values converted to their types."""
    assert parse_command(line) == command


@pytest.mark.parametrize("line", ["hello", "  what is /etc?", "//usr/bin is a path", ""])
def test_messages_are_not_commands(line):
    """Lines not starting with a single / are messages."""
    assert parse_command(line) is None


@pytest.mark.parametrize("line, error", [
    ("/frobnicate", "unknown command /frobnicate; type /? for help"),
    ("/set max_tokens 0", "/set max_tokens: must be a positive whole number, not 0"),
    ("/set max_tokens many", "/set max_tokens: expected a whole number, not many"),
    ("/set temperature -1", "/set temperature: must be a number >= 0, not -1"),
    ("/set temperature hot", "/set temperature: expected a number, not hot"),
    ("/set top_p 1.5", "/set top_p: must be in (0, 1], not 1.5"),
    ("/set min_p 1.5", "/set min_p: must be in [0, 1], not 1.5"),
    ("/set frequency_penalty 2.5", "/set frequency_penalty: must be in [-2, 2], not 2.5"),
    ("/set presence_penalty nan", "/set presence_penalty: must be in [-2, 2], not nan"),
    ("/set repetition_penalty 0", "/set repetition_penalty: must be in (0, 10], not 0"),
    ("/set repetition_penalty many", "/set repetition_penalty: expected a number, not many"),
    ("/set max_tokens", "usage: /set max_tokens <value>"),
    ("/show everything", "usage: /show session|system|stats|settings"),
    ("/resume", "usage: /resume <id>"),
    ("/read", "usage: /read <file>"),
    ("/clear now", "/clear takes no argument"),
])
def test_bad_commands_say_why(line, error):
    """A command that cannot run raises CommandError with a usage hint."""
    with pytest.raises(CommandError) as info:
        parse_command(line)
    assert str(info.value) == error


def test_unknown_setting_lists_the_settings():
    """/set with an unknown name lists what can be set."""
    with pytest.raises(CommandError, match=r"usage: /set system <text> \| /set max_tokens N"):
        parse_command("/set colour blue")


def test_double_slash_sends_a_message_starting_with_slash():
    """`//x` is sent as the message `/x`."""
    assert message_text("//etc/hosts") == "/etc/hosts"
    assert message_text("  hi  ") == "hi"


@pytest.mark.parametrize("text, is_open", [
    ('"""', True),
    ('"""first line\nsecond', True),
    ('"""a\nb"""', False),
    ("plain", False),
    ('/set system """You are\nterse', True),
])
def test_fence_open(text, is_open):
    """Enter continues the input while a triple-quote fence is unclosed."""
    assert fence_open(text) is is_open


@pytest.mark.parametrize("text, result", [
    ('"""\nline one\nline two\n"""', "line one\nline two"),
    ('"""one line"""', "one line"),
    ('/set system """You are\nterse"""', "/set system You are\nterse"),
    ('"""unclosed\nrest', "unclosed\nrest"),
    ("no fence", "no fence"),
])
def test_unfence(text, result):
    """Fences and the line breaks just inside them are removed."""
    assert unfence(text) == result
