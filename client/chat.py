"""One conversation with the daemon, as the chat REPL sees it.

Owns the connection and the session it is attached to: opening a new
session (with instructions) or resuming a known one, recording sessions in
the session file once the daemon stores them, sending messages, streaming
replies, and reconnecting (resuming the same session) when the connection
drops. Knows nothing of prompts or slash commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, TypeVar

from .connection import Connection, Endpoint, RetryPolicy, open_connection
from .errors import ClientError, ConnectionLost, DaemonNotRunning
from .reply import Interrupts, Renderer, Reply, stream_reply
from .sessions import SavedSession, SessionStore

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ChatConfig:
    """What `streamchat chat` was asked to do."""

    endpoint: Endpoint
    system: str | None = None  # instructions for a new session
    resume: str | None = None  # a known session id (or prefix) to attach to
    options: dict = field(default_factory=dict)  # response.create options
    retry: RetryPolicy = RetryPolicy()
    reconnect: RetryPolicy = RetryPolicy(attempts=8)


def user_message(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


class ChatSession:
    """The connection, the attached session and its bookkeeping."""

    def __init__(self, config: ChatConfig, store: SessionStore) -> None:
        self.config = config
        self.store = store
        self.options = dict(config.options)
        self.conn: Connection | None = None
        self.saved: SavedSession | None = None
        self.stored = False  # the daemon stores a new session at its first item

    @property
    def session(self) -> dict:
        return self.conn.session if self.conn else {}

    @property
    def instructions(self) -> str:
        return str(self.session.get("instructions") or "")

    async def start(self) -> None:
        if self.config.resume:
            await self.attach(self.config.resume)
        else:
            await self.new_session(self.config.system or "")

    async def new_session(self, instructions: str) -> None:
        """Replaces the connection with one to a new session."""
        conn = await open_connection(self.config.endpoint, retry=self.config.retry)
        await self._replace(conn)
        self.saved = SavedSession(conn.session_id, conn.resume_token or "",
                                  self.config.endpoint.url, instructions)
        self.stored = False
        if instructions:
            await self.set_instructions(instructions)

    async def attach(self, id_or_prefix: str) -> None:
        """Replaces the connection with one resuming a session from the session file."""
        saved = self.store.find(id_or_prefix)
        if saved is None:
            raise ClientError(f"no session {id_or_prefix} in {self.store.path}; "
                              "/sessions lists the sessions this client knows")
        conn = await open_connection(self.config.endpoint, resume=(saved.id, saved.resume_token),
                                     retry=self.config.retry)
        await self._replace(conn)
        self.saved, self.stored = saved, True
        self.store.touch(saved.id, instructions=self.instructions)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()

    async def set_instructions(self, text: str) -> None:
        session = {"type": "realtime", "instructions": text}
        updated = await self.call(lambda c: c.request("session.update", "session.updated",
                                                      session=session))
        assert self.conn is not None
        self.conn.session = {**self.conn.session, **(updated.get("session") or {})}
        self.remember(instructions=self.instructions)

    async def add_user_text(self, text: str, title: str) -> None:
        """Adds a user message to the context without asking for a reply."""
        await self.call(lambda c: c.request("conversation.item.create", "conversation.item.added",
                                            item=user_message(text)))
        self.remember(title=title)

    async def stats(self) -> dict:
        return await self.call(lambda c: c.request("streamchat.session.stats",
                                                   "streamchat.session.stats"))

    async def say(self, text: str, renderer: Renderer) -> Reply | None:
        """Sends a user message and streams the reply; None if Ctrl-C came before the reply."""
        interrupts = Interrupts()
        with _sigint_presses(interrupts):
            await self.add_user_text(text, title=text)
            if interrupts.presses:
                return None
            return await self._stream(renderer, interrupts)

    async def reply(self, renderer: Renderer) -> Reply:
        """Streams another reply to the context so far; Ctrl-C cancels it."""
        interrupts = Interrupts()
        with _sigint_presses(interrupts):
            return await self._stream(renderer, interrupts)

    async def _stream(self, renderer: Renderer, interrupts: Interrupts) -> Reply:
        reply = await self.call(lambda c: stream_reply(c, renderer, self.options, interrupts))
        if reply.status == "lost":
            await self.reconnect()
        return reply

    async def call(self, action: Callable[[Connection], Awaitable[T]]) -> T:
        """Runs `action`; if the connection was lost, reconnects and runs it once more."""
        if self.conn is None:
            await self.reconnect()
        assert self.conn is not None
        try:
            return await action(self.conn)
        except ConnectionLost:
            await self.reconnect()
            return await action(self.conn)

    async def reconnect(self) -> None:
        """Opens a new connection to the same session, retrying with backoff."""
        last: ClientError | None = None
        for delay in (0.0, *self.config.reconnect.delays()):
            await asyncio.sleep(delay)
            try:
                await self._reopen()
                return
            except (DaemonNotRunning, ConnectionLost) as exc:
                last = exc
                log.info("reconnect failed: %s", exc)
        raise ClientError(f"could not reconnect: {last}")

    def remember(self, **changes: object) -> None:
        """Records the session in the session file (first use) or updates it."""
        if self.saved is None:
            return
        if "title" in changes:
            title = _title(str(changes.pop("title")))
            if not self.saved.title:
                changes["title"] = title
        for name, value in changes.items():
            setattr(self.saved, name, value)
        if self.stored:
            self.store.touch(self.saved.id, **changes)
        else:
            self.store.save(self.saved)
            self.stored = True

    async def _reopen(self) -> None:
        if self.saved is None or not self.stored:
            await self.new_session(self.saved.instructions if self.saved else "")
            return
        conn = await open_connection(self.config.endpoint,
                                     resume=(self.saved.id, self.saved.resume_token),
                                     retry=self.config.retry)
        await self._replace(conn)

    async def _replace(self, conn: Connection) -> None:
        old, self.conn = self.conn, conn
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 60 else line[:59] + "…"


@contextlib.contextmanager
def _sigint_presses(interrupts: Interrupts) -> Iterator[None]:
    """Ctrl-C counts as a press on `interrupts` instead of raising, meanwhile."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, interrupts.press)
    except (NotImplementedError, RuntimeError, ValueError):
        yield  # not the main thread, or no signals here: Ctrl-C stays KeyboardInterrupt
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
