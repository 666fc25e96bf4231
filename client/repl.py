"""The chat REPL: reads inputs, runs slash commands, sends messages.

Input comes from a reader (prompt_toolkit or a pipe, see prompt), output
goes to a UI (plain or rich, see render), and the conversation itself is a
ChatSession. Commands are parsed by the pure `commands.parse_command`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from .chat import ChatSession
from .commands import HELP, Command, CommandError, message_text, parse_command, unfence
from .errors import ClientError
from .render import format_stats
from .reply import Renderer, Reply
from .sessions import SavedSession

EXIT_HINT = "Use Ctrl-D or /bye to exit."
OPTION_NAMES = {"max_tokens": "max_output_tokens", "temperature": "temperature",
                "top_p": "top_p", "top_k": "top_k", "seed": "seed", "min_p": "min_p",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                "repetition_penalty": "repetition_penalty"}


class Reader(Protocol):
    async def read(self) -> str | None: ...


class UI(Protocol):
    def renderer(self) -> Renderer: ...
    def show(self, text: str) -> None: ...
    def info(self, text: str) -> None: ...
    def error(self, text: str) -> None: ...


class Repl:
    """Runs inputs until /bye or the end of input."""

    def __init__(self, chat: ChatSession, ui: UI, reader: Reader) -> None:
        self.chat = chat
        self.ui = ui
        self.reader = reader

    async def run(self) -> int:
        await self.chat.start()
        self.ui.info(self._banner())
        try:
            while await self._step():
                pass
        finally:
            await self.chat.close()
        return 0

    async def handle(self, line: str) -> bool:
        """Runs one input; False when it asks to leave."""
        text = unfence(line)
        try:
            command = parse_command(text)
            if command is None:
                if message_text(text):
                    await self._say(message_text(text))
                return True
            if command.name == "bye":
                return False
            await self._run(command)
        except (CommandError, ClientError) as exc:
            self.ui.error(str(exc))
        return True

    async def _step(self) -> bool:
        try:
            line = await self.reader.read()
        except KeyboardInterrupt:
            self.ui.info(EXIT_HINT)
            return True
        return line is not None and await self.handle(line)

    async def _say(self, message: str) -> None:
        reply = await self.chat.say(message, self.ui.renderer())
        if reply is None:
            self.ui.info("interrupted: the message was added, no reply asked (/regen asks)")
        else:
            self._after(reply)

    def _after(self, reply: Reply) -> None:
        if reply.status == "lost":
            self.ui.info(f"reconnected to {self.chat.conn.session_id if self.chat.conn else '?'} "
                         f"({self._restored()}); the partial reply is kept as incomplete")

    async def _run(self, command: Command) -> None:
        handler = getattr(self, "_cmd_" + command.name)
        await handler(command)

    async def _cmd_help(self, command: Command) -> None:
        self.ui.show(HELP)

    async def _cmd_set(self, command: Command) -> None:
        if command.key == "system":
            await self.chat.set_instructions(str(command.value))
            self.ui.info("system instructions " + ("set" if command.value else "cleared"))
            return
        self.chat.options[OPTION_NAMES[command.key]] = command.value
        self.ui.info(f"{command.key} = {command.value}")

    async def _cmd_show(self, command: Command) -> None:
        if command.key == "system":
            self.ui.show(self.chat.instructions or "(no system instructions)")
        elif command.key == "stats":
            self.ui.show(format_stats(await self.chat.stats()))
        elif command.key == "settings":
            options = self.chat.options
            self.ui.show("\n".join(f"{k} = {v}" for k, v in options.items()) or "(daemon defaults)")
        else:
            self.ui.show(self._describe_session())

    async def _cmd_clear(self, command: Command) -> None:
        await self.chat.new_session(self.chat.instructions)
        self.ui.info(f"new session {self.chat.conn.session_id if self.chat.conn else '?'}")

    async def _cmd_regen(self, command: Command) -> None:
        # The protocol cannot delete items: the earlier reply stays in the context.
        self._after(await self.chat.reply(self.ui.renderer()))

    async def _cmd_sessions(self, command: Command) -> None:
        current = self.chat.conn.session_id if self.chat.conn else ""
        self.ui.show(format_sessions(self.chat.store.load(), current))

    async def _cmd_resume(self, command: Command) -> None:
        await self.chat.attach(str(command.value))
        self.ui.info(self._banner())

    async def _cmd_read(self, command: Command) -> None:
        path = Path(str(command.value)).expanduser()
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ClientError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if not text.strip():
            raise ClientError(f"{path} is empty")
        await self.chat.add_user_text(f"{path.name}:\n\n{text}", title=f"/read {path.name}")
        self.ui.info(f"added {path.name} ({len(text):,} characters) to the conversation")

    def _banner(self) -> str:
        session = self.chat.session
        head = (f"resumed session {session.get('id')} ({self._restored()})"
                if self.chat.conn and self.chat.conn.restored_from
                else f"new session {session.get('id')}")
        return f"{head} · model {session.get('model', '?')} · /? for help, /bye to leave"

    def _restored(self) -> str:
        where = self.chat.conn.restored_from if self.chat.conn else None
        return f"restored from {where}" if where else "new"

    def _describe_session(self) -> str:
        session = self.chat.session
        trunc = session.get("truncation") or {}
        lines = [f"session   {session.get('id')} ({self._restored()})",
                 f"daemon    {self.chat.config.endpoint.url}",
                 f"model     {session.get('model', '?')}",
                 f"window    {trunc.get('sink_tokens', '?')} sink"
                 f" + {trunc.get('window_tokens', '?')} window tokens,"
                 f" blocks of {trunc.get('block_size', '?')}",
                 f"system    {_first_line(self.chat.instructions) or '(none)'}"]
        return "\n".join(lines)


def format_sessions(sessions: list[SavedSession], current: str) -> str:
    """One line per known session, most recent first; * marks the current one."""
    if not sessions:
        return "no sessions yet"
    rows = []
    for saved in sessions:
        mark = "*" if saved.id == current else " "
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(saved.last_used))
        rows.append(f"{mark} {saved.id}  {when}  {saved.title or _first_line(saved.instructions)}")
    return "\n".join(rows)


def _first_line(text: str) -> str:
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= 60 else line[:59] + "…"
