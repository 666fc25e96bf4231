"""Where chat input comes from: prompt_toolkit on a terminal, lines from a pipe.

Both readers return one input (possibly several lines) per `read()`, None at
the end (Ctrl-D), and raise KeyboardInterrupt for Ctrl-C at an empty prompt.
Enter sends unless a \"\"\" fence is open; Esc-Enter always adds a line;
bracketed paste inserts pasted text with its lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from .commands import fence_open
from .lines import LineSource

PROMPT = ">>> "
PLACEHOLDER = "Send a message (/? for help)"


class TerminalInput:
    """A prompt_toolkit prompt with persistent history."""

    def __init__(self, history_path: Path | None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.formatted_text import FormattedText
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history = FileHistory(str(history_path)) if history_path else InMemoryHistory()
        self._session = PromptSession(
            history=history, multiline=True, key_bindings=_key_bindings(),
            prompt_continuation=lambda width, line_number, wrap: "... ".rjust(width),
            placeholder=FormattedText([("class:placeholder fg:ansibrightblack", PLACEHOLDER)]),
        )

    async def read(self) -> str | None:
        try:
            return await self._session.prompt_async(PROMPT)
        except EOFError:
            return None


class StreamInput:
    """Inputs read from a non-terminal stream: a line each, or a fenced block."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines = LineSource(stream)

    async def read(self) -> str | None:
        text = await self._lines.get()
        if text is None:
            return None
        while fence_open(text):
            more = await self._lines.get()
            if more is None:
                break
            text += more
        return text.rstrip("\n")


def _key_bindings():
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("enter")
    def _enter(event) -> None:
        buffer = event.current_buffer
        if fence_open(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    return bindings
