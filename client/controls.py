"""Control characters in text from the daemon are shown on the terminal, never obeyed.

A reply is the model's text, and a model can write what a terminal takes as
a command: ESC sequences that clear the screen, set the window title or
remap keys, BEL, C1 controls (U+009B is a one-character CSI), and the
bidirectional overrides and isolates that make shown text read otherwise
than it is. Each becomes a visible escape, `\\x1b`, `\\x9b`, `\\u202e`;
newline and tab stay. Every path from the daemon to the terminal (replies,
status lines, messages, errors, log lines) goes through `escape_controls`.
Pure: no I/O.

    escaped   U+0000-0008, U+000B-001F (C0 but tab, newline), U+007F (DEL),
              U+0080-009F (C1), U+202A-202E, U+2066-2069 (bidi)
"""

from __future__ import annotations

import logging

_CONTROLS = [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F),
             *range(0x2066, 0x206A)]
_TABLE = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROLS}


def escape_controls(text: str) -> str:
    """`text` with every control character above written as a visible escape."""
    return text.translate(_TABLE)


class EscapingFormatter(logging.Formatter):
    """Log lines (which quote the daemon's events) with their control characters escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))
