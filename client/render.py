"""Showing replies: plain text for pipes, Markdown as it streams on a terminal.

A renderer gets `start()`, any number of `feed(delta)` and one
`finish(status)`. The plain one writes deltas as they come, so its output is
exactly the reply text followed by a status line. The rich one prints
finished Markdown chunks (see mdstream) above a small transient live area
holding the unfinished tail, at most `max_refresh_per_s` times a second.
Also formats the status line and the cache statistics. Everything from the
daemon is shown with its control characters escaped (`controls`), never
passed to the terminal raw. No websockets here.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable, TextIO

from .controls import escape_controls
from .mdstream import Chunk, MarkdownChunker

REFRESH_PER_S = 15.0


def format_status(response: dict) -> str:
    """The dim line after a reply, from a `response.done` response object."""
    usage = response.get("usage") or {}
    timing = usage.get("timing") or {}
    parts = []
    if "output_tokens" in usage:
        parts.append(f"{_n(usage['output_tokens'])} tokens")
    if isinstance(timing.get("ttft_ms"), (int, float)):
        parts.append(f"first token {timing['ttft_ms']:.0f} ms")
    if isinstance(timing.get("output_tokens_per_s"), (int, float)):
        parts.append(f"{timing['output_tokens_per_s']:.1f} tokens/s")
    cached = (usage.get("input_token_details") or {}).get("cached_tokens")
    if cached is not None:
        parts.append(f"{_n(cached)} cached")
    status = response.get("status", "completed")
    if status != "completed":
        details = response.get("status_details") or {}
        reason = details.get("reason") or (details.get("error") or {}).get("message")
        parts.insert(0, f"{status}" + (f" ({reason})" if reason else ""))
    return " · ".join(parts)


def format_stats(stats: dict) -> str:
    """The answer to `streamchat.session.stats`, for a person."""
    blocks = stats.get("blocks") or {}
    return (f"context {_n(stats.get('context_tokens'))} tokens"
            f" · total {_n(stats.get('total_tokens'))}"
            f" · evicted {_n(stats.get('evicted_tokens'))}"
            f"\nblocks {_n(blocks.get('owned'))} owned, {_n(blocks.get('shared'))} shared"
            f" · KV {human_bytes(stats.get('kv_bytes'))} · {_n(stats.get('items'))} items")


def human_bytes(num: object) -> str:
    if not isinstance(num, (int, float)):
        return "?"
    size = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _n(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


class PlainRenderer:
    """Writes the reply as it streams, then the status line."""

    def __init__(self, out: TextIO, status_out: TextIO | None = None) -> None:
        self._out = out
        self._status_out = status_out or out
        self._last = "\n"

    def start(self) -> None:
        self._last = "\n"

    def feed(self, delta: str) -> None:
        delta = escape_controls(delta)
        if delta:
            self._out.write(delta)
            self._out.flush()
            self._last = delta[-1]

    def finish(self, status: str) -> None:
        if self._last != "\n":
            self._out.write("\n")
            self._out.flush()
        if status:
            self._status_out.write(escape_controls(status) + "\n")
            self._status_out.flush()


class RichRenderer:
    """Streams Markdown to a terminal through a rich Console."""

    def __init__(self, console, max_refresh_per_s: float = REFRESH_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._interval = 1.0 / max_refresh_per_s
        self._clock = clock
        self._chunker = MarkdownChunker()
        self._done: list[Chunk] = []
        self._live = None
        self._last_refresh = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self.refreshes = 0

    def start(self) -> None:
        from rich.live import Live

        width = max(self._console.width, 20)
        self._chunker = MarkdownChunker(max_lines=6, max_chars=width * 4)
        self._done = []
        self._live = Live(console=self._console, auto_refresh=False, transient=True,
                          vertical_overflow="crop")
        self._live.start()

    def feed(self, delta: str) -> None:
        self._done += self._chunker.push(escape_controls(delta))
        wait = self._interval - (self._clock() - self._last_refresh)
        if wait <= 0:
            self._refresh()
        elif self._timer is None:
            try:  # show the tail even if no delta follows soon
                self._timer = asyncio.get_running_loop().call_later(wait, self._refresh)
            except RuntimeError:
                pass  # no loop: finish() shows everything

    def finish(self, status: str) -> None:
        self._cancel_timer()
        self._done += self._chunker.close()
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._done:
            self._console.print(self._group(self._done))
            self._done = []
        if status:
            self._console.print(escape_controls(status), style="dim", markup=False, highlight=False)

    def _refresh(self) -> None:
        self._cancel_timer()
        if self._live is None:
            return
        self._last_refresh = self._clock()
        self.refreshes += 1
        self._live.update(_renderable(self._chunker.pending()), refresh=True)
        if self._done:  # printed above the live area, once
            self._live.console.print(self._group(self._done))
            self._done = []

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @staticmethod
    def _group(chunks: list[Chunk]):
        from rich.console import Group

        return Group(*(_renderable(chunk) for chunk in chunks))


def _renderable(chunk: Chunk):
    from rich.markdown import Markdown
    from rich.syntax import Syntax
    from rich.text import Text

    if chunk.kind == "code":
        return Syntax(chunk.text, chunk.lang or "text", theme="monokai", word_wrap=True,
                      padding=(0, 1))
    if chunk.kind == "markdown" and chunk.text:
        return _Trimmed(Markdown(chunk.text))
    return Text("")


class _Trimmed:
    """A renderable without its leading and trailing blank lines, its text's controls escaped.

    rich opens lists, quotes and tables with a blank line; the chunker's
    gaps already space the blocks, so each chunk is printed tight. Markdown
    turns character references (`&#x202e;`) into characters: the rendered
    text is escaped again.
    """

    def __init__(self, inner) -> None:
        self.inner = inner

    def __rich_console__(self, console, options):
        from rich.segment import Segment

        lines = console.render_lines(self.inner, options, pad=False)
        while lines and _blank(lines[0]):
            lines.pop(0)
        while lines and _blank(lines[-1]):
            lines.pop()
        for line in lines:
            for segment in line:
                yield segment if segment.control else Segment(escape_controls(segment.text), segment.style)
            yield Segment.line()


def _blank(line) -> bool:
    return not "".join(segment.text for segment in line).strip()


class PlainUI:
    """Plain text: replies and asked-for output on stdout, notes and errors on stderr."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def renderer(self) -> PlainRenderer:
        return PlainRenderer(self.out)

    def show(self, text: str) -> None:
        print(escape_controls(text), file=self.out, flush=True)

    def info(self, text: str) -> None:
        print(escape_controls(text), file=self.err, flush=True)

    def error(self, text: str) -> None:
        print(escape_controls(text), file=self.err, flush=True)


class RichUI:
    """Messages and replies on a terminal, through rich."""

    def __init__(self, console=None, err_console=None) -> None:
        from rich.console import Console

        self.console = console or Console(highlight=False)
        self.err_console = err_console or Console(stderr=True, highlight=False)

    def renderer(self) -> RichRenderer:
        return RichRenderer(self.console)

    def show(self, text: str) -> None:
        self.console.print(escape_controls(text), markup=False, highlight=False)

    def info(self, text: str) -> None:
        self.console.print(escape_controls(text), style="dim", markup=False, highlight=False)

    def error(self, text: str) -> None:
        self.err_console.print(escape_controls(text), style="bold red", markup=False, highlight=False)


def make_ui(plain: bool) -> PlainUI | RichUI:
    """The plain UI, or the rich one for a terminal that can draw."""
    return PlainUI() if plain else RichUI()
