"""Tests of reply rendering: plain output, status lines, Markdown chunking and the rich live area."""

import asyncio
import io
import re

import pytest
from client_fake_daemon import FakeDaemon
from rich.console import Console

from streamchat.client.connection import Endpoint, open_connection
from streamchat.client.mdstream import Chunk, MarkdownChunker
from streamchat.client.render import PlainRenderer, RichRenderer, format_stats, format_status
from streamchat.client.reply import stream_reply

USAGE = {"input_tokens": 50, "output_tokens": 1234, "total_tokens": 1284,
         "input_token_details": {"cached_tokens": 2048},
         "timing": {"ttft_ms": 85.4, "output_tokens_per_s": 41.26}}
DOC = ("First paragraph line.\n\nSecond paragraph\nwith two lines.\n\n- item one\n- item two\n\n"
       "| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\ncode line\n```\nThe end.")
DOC_SCREEN = ["First paragraph line.", "", "Second paragraph with two lines.", "",
              " • item one", " • item two", "", " a  b", " ────", " 1  2", "",
              " code line", "", "The end.", "9 tokens"]


def screen(output: str) -> list[str]:
    """Replays output on a tiny terminal: text, newline, CR, erase line and cursor up."""
    rows, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\n|\r|[^\x1b\n\r]+", output):
        if token == "\n":
            row, col = row + 1, 0
            rows += [""] if row == len(rows) else []
        elif token == "\r":
            col = 0
        elif token == "\x1b[2K":
            rows[row] = ""
        elif token == "\x1b[1A":
            row = max(row - 1, 0)
        elif not token.startswith("\x1b"):
            line = rows[row].ljust(col)
            rows[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    rows = [r.rstrip() for r in rows]
    return rows[:-1] if rows[-1] == "" else rows


def test_plain_reply_is_the_deltas_then_a_status_line():
    """Streamed through the fake daemon, plain output is exactly the deltas joined, a newline and the status."""
    deltas = ["Hel", "lo", ", wör", "ld ", "🙂"]

    async def main():
        async with FakeDaemon(reply=deltas) as daemon:
            async with await open_connection(Endpoint(daemon.url)) as conn:
                out = io.StringIO()
                reply = await stream_reply(conn, PlainRenderer(out), {"max_output_tokens": 9})
                return out.getvalue(), reply, daemon.received[0]

    output, reply, create = asyncio.run(asyncio.wait_for(main(), 10))
    status = "5 tokens · first token 12 ms · 40.0 tokens/s · 32 cached"
    assert output == "Hello, wörld 🙂\n" + status + "\n"
    assert (reply.text, reply.status) == ("Hello, wörld 🙂", "completed")
    assert create["response"] == {"max_output_tokens": 9}


def test_plain_renderer_adds_no_newline_after_one_and_can_split_status():
    """A reply ending in a newline gets none added; the status may go to another stream."""
    out, err = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(out, err)
    renderer.start()
    for delta in ["a\n", "b\n"]:
        renderer.feed(delta)
    renderer.finish("2 tokens")
    assert (out.getvalue(), err.getvalue()) == ("a\nb\n", "2 tokens\n")


def test_format_status_from_usage():
    """The status line shows tokens, time to first token, tokens/s and cached tokens."""
    assert format_status({"status": "completed", "usage": USAGE}) == (
        "1,234 tokens · first token 85 ms · 41.3 tokens/s · 2,048 cached")


@pytest.mark.parametrize("status, details, prefix", [
    ("cancelled", {"reason": "client_cancelled"}, "cancelled (client_cancelled) · "),
    ("incomplete", {"reason": "max_output_tokens"}, "incomplete (max_output_tokens) · "),
    ("failed", {"error": {"message": "boom"}}, "failed (boom) · "),
])
def test_format_status_names_unfinished_replies(status, details, prefix):
    """A reply that did not complete says how it ended before the figures."""
    line = format_status({"status": status, "status_details": details, "usage": USAGE})
    assert line == prefix + "1,234 tokens · first token 85 ms · 41.3 tokens/s · 2,048 cached"


def test_format_stats():
    """Cache statistics read as context, total, evicted, blocks, KV bytes and items."""
    stats = {"context_tokens": 2052, "total_tokens": 10000, "evicted_tokens": 7948,
             "blocks": {"owned": 129, "shared": 4}, "kv_bytes": 3 * 2**20 + 2**19, "items": 12}
    assert format_stats(stats) == ("context 2,052 tokens · total 10,000 · evicted 7,948\n"
                                   "blocks 129 owned, 4 shared · KV 3.5 MiB · 12 items")


def test_chunker_finishes_blocks_at_blank_lines_and_code_lines_at_once():
    """Blocks end at blank lines and fences; each code line is finished on its newline."""
    chunker = MarkdownChunker()
    assert chunker.push("Para one\ncontinues") == []
    assert chunker.pending() == Chunk("markdown", "Para one\ncontinues")
    assert chunker.push("\n\n```py\nx = 1\n") == [Chunk("markdown", "Para one\ncontinues"),
                                                Chunk("gap"), Chunk("code", "x = 1", "py")]
    assert chunker.push("y = 2\n```\nEnd") == [Chunk("code", "y = 2", "py")]
    assert chunker.close() == [Chunk("gap"), Chunk("markdown", "End")]


def test_chunker_cuts_long_blocks_and_long_lines_without_losing_words():
    """An open block past max_lines, or a line past max_chars, is finished in pieces that keep every word once."""
    chunker = MarkdownChunker(max_lines=3, max_chars=40)
    chunks = chunker.push("- a\n- b\n- c\n- d\n")
    assert chunks == [Chunk("markdown", "- a\n- b\n- c")]
    words = [f"w{i}" for i in range(40)]
    for word in words:
        chunks += chunker.push(word + " ")
    chunks += chunker.close()
    text = " ".join(c.text for c in chunks if c.kind == "markdown")
    assert text.split() == ["-", "a", "-", "b", "-", "c", "-", "d"] + words
    assert all(len(c.text) <= 40 for c in chunks[1:])
    assert Chunk("gap") not in chunks


def test_chunker_keeps_inline_markup_whole_when_cutting():
    """A long line is not cut inside `code` or **bold**."""
    chunker = MarkdownChunker(max_chars=20)
    chunks = chunker.push("aa bb `cc dd ee ff gg hh` ii **jj kk ll** mm")
    chunks += chunker.close()
    assert [c.text for c in chunks] == ["aa bb `cc dd ee ff gg hh` ii", "**jj kk ll** mm"]


def rich_render(deltas, width=40, step_s=0.05):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, height=20, color_system=None)
    now = [0.0]
    renderer = RichRenderer(console, clock=lambda: now[0])
    renderer.start()
    for delta in deltas:
        now[0] += step_s
        renderer.feed(delta)
    renderer.finish("9 tokens")
    return out.getvalue(), renderer.refreshes


@pytest.mark.parametrize("size", [1, 3, 7, len(DOC)])
def test_rich_streaming_leaves_each_line_once(size):
    """However the reply is split, the terminal ends up showing every rendered line once, then the status."""
    output, _ = rich_render([DOC[i:i + size] for i in range(0, len(DOC), size)])
    assert screen(output) == DOC_SCREEN


def test_rich_refreshes_at_most_15_times_a_second():
    """1000 deltas in one (simulated) second cause at most 16 live refreshes."""
    _, refreshes = rich_render(["word "] * 1000, step_s=0.001)
    assert 10 <= refreshes <= 16
