"""Splits streamed Markdown into finished chunks and an unfinished tail.

The rich renderer prints finished chunks once, above a small live area that
shows only the tail, so no line is ever printed twice or dropped:

    text so far:  | para one ...\\n\\n | - item\\n- item\\n | - ite
                  +-- finished -------+-- open block ----+-- partial line
                  printed for good     shown live (at most max_lines lines)

A block ends at a blank line or a code fence; complete code lines are
finished at once; an open block that grows past `max_lines` lines, or a
partial line past `max_chars`, is cut at a line (or word) boundary.
Pure: no rich, no I/O.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)")


class Chunk(NamedTuple):
    """A piece of the reply: kind is "markdown", "code" (one or more lines) or "gap"."""

    kind: str
    text: str = ""
    lang: str = ""


class MarkdownChunker:
    """Feed it deltas; it returns what is finished."""

    def __init__(self, max_lines: int = 8, max_chars: int = 640) -> None:
        self.max_lines = max_lines
        self.max_chars = max_chars
        self._partial = ""  # the line being written
        self._lines: list[str] = []  # complete lines of the open block
        self._fence: tuple[str, str] | None = None  # (marker, lang) inside a code fence
        self._gap = False  # a blank line is due before the next chunk
        self._emitted = False

    def push(self, delta: str) -> list[Chunk]:
        """Adds streamed text; returns the chunks it finished."""
        out: list[Chunk] = []
        self._partial += delta
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            out += self._line(line)
        while self._fence is None and len(self._partial) > self.max_chars:
            cut = self._cut_partial()
            if not cut:
                break
            out += cut
        return out

    def close(self) -> list[Chunk]:
        """Ends the stream; returns everything not yet finished."""
        out: list[Chunk] = []
        if self._partial:
            line, self._partial = self._partial, ""
            out += self._line(line)
        return out + self._flush_block()

    def pending(self) -> Chunk:
        """The unfinished tail, for the live area."""
        if self._fence is not None:
            return Chunk("code", self._partial, self._fence[1])
        return Chunk("markdown", "\n".join(self._lines + [self._partial]).strip("\n"))

    def _line(self, line: str) -> list[Chunk]:
        if self._fence is not None:
            marker = self._fence[0]
            if line.strip().startswith(marker) and not line.strip().strip(marker[0]):
                self._fence, self._gap = None, True
                return []
            return self._emit(Chunk("code", line, self._fence[1]))
        match = _FENCE.match(line)
        if match:
            out = self._flush_block()
            self._fence = (match.group(1), match.group(2))
            self._gap = self._gap or self._emitted
            return out
        if not line.strip():
            return self._flush_block()
        self._lines.append(line)
        if len(self._lines) >= self.max_lines and not _is_table(self._lines):
            text, self._lines = "\n".join(self._lines), []
            return self._emit(Chunk("markdown", text))
        return []

    def _flush_block(self) -> list[Chunk]:
        if not self._lines:
            return []
        text, self._lines = "\n".join(self._lines), []
        out = self._emit(Chunk("markdown", text))
        self._gap = True
        return out

    def _cut_partial(self) -> list[Chunk]:
        """Finishes the front of an overlong line at a word boundary outside markup."""
        out: list[Chunk] = []
        if self._lines:  # the same block goes on: no gap after these lines
            text, self._lines = "\n".join(self._lines), []
            out = self._emit(Chunk("markdown", text))
        keep = self.max_chars // 2
        for pos in range(len(self._partial) - keep, 0, -1):
            head = self._partial[:pos]
            if self._partial[pos] == " " and _balanced(head):
                self._partial = self._partial[pos + 1:]
                return out + self._emit(Chunk("markdown", head))
        return out

    def _emit(self, chunk: Chunk) -> list[Chunk]:
        out = [Chunk("gap")] if self._gap and self._emitted else []
        self._gap, self._emitted = False, True
        return out + [chunk]


def _is_table(lines: list[str]) -> bool:
    return all(line.lstrip().startswith("|") for line in lines) and len(lines) < 64


def _balanced(text: str) -> bool:
    """True if no inline code, emphasis or link is left open in `text`."""
    strong = text.count("**")
    return (text.count("`") % 2 == 0 and strong % 2 == 0 and (text.count("*") - 2 * strong) % 2 == 0
            and text.count("[") == text.count("]") and text.count("(") == text.count(")"))
