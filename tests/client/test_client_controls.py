"""Tests that control characters from the daemon reach the terminal as visible escapes, never raw."""

import asyncio
import io
import logging
import re

from client_fake_daemon import FakeDaemon
from rich.console import Console
from test_client_chat import FAST, Script  # tests/client is on sys.path
from test_client_render import screen

from streamchat.client.chat import ChatConfig, ChatSession
from streamchat.client.connection import Endpoint
from streamchat.client.controls import EscapingFormatter, escape_controls
from streamchat.client.render import PlainUI, RichRenderer, RichUI
from streamchat.client.repl import Repl
from streamchat.client.sessions import SessionStore

ATTACK = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, set the window title
SHOWN = "\\x1b[2J\\x1b]0;pwned\\x07"
REPLY = ["Hi ", ATTACK, " and \x9b31m red \u202eevil\u2069 \x7f\r done\tok\n"]
REPLY_SHOWN = "Hi " + SHOWN + " and \\x9b31m red \\u202eevil\\u2069 \\x7f\\x0d done\tok\n"
STATUS = "3 tokens · first token 12 ms · 40.0 tokens/s · 32 cached"
# what rich itself writes around a live area: cursor moves, line erases, cursor hide/show
RICH_OWN = re.compile(r"\x1b\[(?:\?25[lh]|2K|1A|[0-9;]*m)|\r")


def test_every_control_is_escaped_and_nothing_else():
    """C0 but tab and newline, DEL, C1 and the bidi overrides and isolates are escaped; every other
    character below U+3000 passes as it is."""
    controls = {*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F),
                *range(0x2066, 0x206A)}
    for cp in range(0x3000):
        want = (f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}") if cp in controls else chr(cp)
        assert escape_controls(chr(cp)) == want, hex(cp)
    assert escape_controls(ATTACK) == SHOWN


def chat_once(ui_factory, tmp_path):
    """One message through the fake daemon whose reply carries escape sequences; the UI's streams."""
    async def main():
        async with FakeDaemon(reply=REPLY) as daemon:
            ui, streams = ui_factory()
            config = ChatConfig(Endpoint(daemon.url), retry=FAST, reconnect=FAST)
            await Repl(ChatSession(config, SessionStore(tmp_path / "s.json")), ui, Script("hello")).run()
            return [s.getvalue() for s in streams]

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_plain_chat_writes_escapes_exactly(tmp_path):
    """Piped output is the reply with every control written as its escape, then the status line."""
    def plain():
        out, err = io.StringIO(), io.StringIO()
        return PlainUI(out, err), (out, err)

    out, err = chat_once(plain, tmp_path)
    assert out == REPLY_SHOWN + STATUS + "\n"
    assert "\x1b" not in out + err and "\x07" not in out + err


def test_a_terminal_chat_writes_no_control_but_richs_own(tmp_path):
    """On a terminal (rich, Markdown streaming) the bytes hold no ESC, BEL, C1 or bidi character except
    rich's own cursor and style sequences, and the screen shows the escaped reply."""
    def rich():
        out, err = io.StringIO(), io.StringIO()
        console = Console(file=out, force_terminal=True, width=100, height=20, color_system="standard")
        return RichUI(console, Console(file=err, force_terminal=True, color_system="standard")), (out, err)

    out, err = chat_once(rich, tmp_path)
    rest = RICH_OWN.sub("", out + err)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", rest), repr(rest)
    assert screen(out)[-2:] == [REPLY_SHOWN.rstrip("\n").expandtabs(8), STATUS]


def test_markdown_character_references_are_escaped_too():
    """`&#x202e;` in Markdown becomes U+202E when rendered: the rendered text is escaped again."""
    out = io.StringIO()
    renderer = RichRenderer(Console(file=out, force_terminal=True, width=60, color_system=None))
    renderer.start()
    renderer.feed("left &#x202e;right&#x2066; end\n\n")
    renderer.finish("")
    assert "\u202e" not in out.getvalue() and "\u2066" not in out.getvalue()
    assert "left \\u202eright\\u2066 end" in screen(out.getvalue())


def test_log_lines_quoting_events_are_escaped():
    """`-v` logs the daemon's events: the formatter escapes their controls."""
    record = logging.LogRecord("streamchat.client", logging.INFO, __file__, 1, "error: %s", (ATTACK,), None)
    assert EscapingFormatter("%(levelname)s %(message)s").format(record) == "INFO error: " + SHOWN
