"""`streamchat feed`: streams a text source into a session as it arrives.

Each line is sent with `streamchat.input_text.append` (waiting for its
`appended` answer, which keeps lines in order and paces the feed); a blank
line, or `commit_idle_s` without input, closes the open item with
`streamchat.input_text.commit`. Progress goes to stderr; with `ask`, a
question is asked at the end and the answer printed on stdout. A new
session's id is printed on stdout first and recorded in the session file, so
`chat` can `/resume` it. Knows nothing of prompts.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import IO, TextIO

from .chat import user_message
from .connection import Connection, Endpoint, RetryPolicy, open_connection
from .errors import ClientError, ConnectionLost, DaemonNotRunning
from .lines import LineSource
from .render import PlainRenderer
from .reply import Renderer, stream_reply
from .sessions import SavedSession, SessionStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeedConfig:
    """What `streamchat feed` was asked to do."""

    endpoint: Endpoint
    session: str | None = None  # a session id (or prefix); None: a new session
    resume_token: str | None = None
    system: str | None = None
    source: str = "-"  # a path, or "-" for standard input
    commit_idle_s: float = 3.0
    ask: str | None = None
    options: dict = field(default_factory=dict)  # response.create options for ask
    quiet: bool = False
    retry: RetryPolicy = RetryPolicy()
    reconnect: RetryPolicy = RetryPolicy(attempts=8)


class FeedProgress:
    """Counts what was fed and shows it on stderr (one rewritten line on a terminal)."""

    def __init__(self, out: TextIO, quiet: bool = False, live: bool | None = None) -> None:
        self.out = out
        self.quiet = quiet
        self.live = out.isatty() if live is None else live
        self.lines = self.tokens = self.items = 0
        self.context_tokens: int | None = None
        self.evicted_tokens: int | None = None
        self._drawn = 0.0

    def appended(self, event: dict) -> None:
        self.lines += 1
        self.tokens += int(event.get("tokens") or 0)
        self.context_tokens = event.get("context_tokens", self.context_tokens)
        if self.live and time.monotonic() - self._drawn > 0.1:
            self._draw()

    def committed(self) -> None:
        self.items += 1

    def stats(self, event: dict) -> None:
        self.context_tokens = event.get("context_tokens", self.context_tokens)
        self.evicted_tokens = event.get("evicted_tokens", self.evicted_tokens)
        self._draw()

    def finish(self) -> None:
        self._draw()
        if self.live and not self.quiet:
            self.out.write("\n")
            self.out.flush()

    def text(self) -> str:
        context = "?" if self.context_tokens is None else f"{self.context_tokens:,}"
        evicted = "?" if self.evicted_tokens is None else f"{self.evicted_tokens:,}"
        return (f"fed {self.lines:,} lines, {self.tokens:,} tokens, {self.items:,} items"
                f" · context {context} tokens · evicted {evicted}")

    def _draw(self) -> None:
        if self.quiet:
            return
        self._drawn = time.monotonic()
        self.out.write(("\r\x1b[K" + self.text()) if self.live else self.text() + "\n")
        self.out.flush()


class Feeder:
    """Sends lines to one session, reconnecting if the connection drops."""

    def __init__(self, config: FeedConfig, conn: Connection, token: str,
                 progress: FeedProgress) -> None:
        self.config = config
        self.conn = conn
        self.token = token
        self.progress = progress
        self.open_item = False

    async def run(self, source: LineSource) -> None:
        """Feeds lines until the source ends; commits at blank lines and idle times."""
        while True:
            timeout = self.config.commit_idle_s if self.open_item else None
            try:
                line = await asyncio.wait_for(source.get(), timeout)
            except asyncio.TimeoutError:
                await self.commit()
                continue
            if line is None:
                break
            if line.strip():
                event = await self.call("streamchat.input_text.append",
                                        "streamchat.input_text.appended", text=line)
                self.progress.appended(event)
                self.open_item = True
            else:
                await self.commit()
        await self.commit()

    async def commit(self) -> None:
        if not self.open_item:
            return
        await self.call("streamchat.input_text.commit", "conversation.item.done")
        self.open_item = False
        self.progress.committed()
        self.progress.stats(await self.call("streamchat.session.stats", "streamchat.session.stats"))

    async def call(self, type_: str, expect: str, **fields: object) -> dict:
        """A request; after a lost connection, reconnects (resuming) and sends it again."""
        try:
            return await self.conn.request(type_, expect, **fields)
        except ConnectionLost as exc:
            log.info("%s; reconnecting", exc)
            await self._reconnect()
            return await self.conn.request(type_, expect, **fields)

    async def _reconnect(self) -> None:
        last: ClientError | None = None
        for delay in (0.0, *self.config.reconnect.delays()):
            await asyncio.sleep(delay)
            try:
                conn = await open_connection(self.config.endpoint,
                                             resume=(self.conn.session_id, self.token),
                                             retry=self.config.retry)
            except (DaemonNotRunning, ConnectionLost) as exc:
                last = exc
                continue
            await self.conn.close()
            self.conn = conn
            return
        raise ClientError(f"could not reconnect: {last}")


async def run_feed(config: FeedConfig, store: SessionStore, stdin: IO[str] | None = None,
                   stdout: TextIO | None = None, stderr: TextIO | None = None,
                   renderer: Renderer | None = None) -> int:
    """Runs one feed; returns the exit status."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    stream = _open_source(config.source, stdin)
    conn, token = await _attach(config, store, stdout)
    progress = FeedProgress(stderr, config.quiet)
    feeder = Feeder(config, conn, token, progress)
    try:
        if config.system is not None:
            await feeder.call("session.update", "session.updated",
                              session={"type": "realtime", "instructions": config.system})
            store.touch(conn.session_id, instructions=config.system)
        await feeder.run(LineSource(stream))
        progress.finish()
        if config.ask:
            return await _ask(feeder, config, renderer or PlainRenderer(stdout, stderr))
        return 0
    finally:
        await feeder.conn.close()
        if stream is not stdin:
            stream.close()


async def _attach(config: FeedConfig, store: SessionStore,
                  stdout: TextIO) -> tuple[Connection, str]:
    """Opens the connection: a new session (printing its id) or a resumed one."""
    if config.session is None:
        conn = await open_connection(config.endpoint, retry=config.retry)
        token = conn.resume_token or ""
        store.save(SavedSession(conn.session_id, token, config.endpoint.url,
                                config.system or "", title="(feed)"))
        print(conn.session_id, file=stdout, flush=True)
        return conn, token
    saved = store.find(config.session)
    token = config.resume_token or (saved.resume_token if saved else None)
    if token is None:
        raise ClientError(f"no resume token for session {config.session}: it is not in "
                          f"{store.path}; pass --resume-token TOKEN")
    session_id = saved.id if saved else config.session
    conn = await open_connection(config.endpoint, resume=(session_id, token), retry=config.retry)
    if saved is None or saved.resume_token != token:
        store.save(SavedSession(session_id, token, config.endpoint.url,
                                str(conn.session.get("instructions") or ""), title="(feed)"))
    else:
        store.touch(session_id)
    return conn, token


async def _ask(feeder: Feeder, config: FeedConfig, renderer: Renderer) -> int:
    assert config.ask is not None
    await feeder.call("conversation.item.create", "conversation.item.added",
                      item=user_message(config.ask))
    reply = await stream_reply(feeder.conn, renderer, config.options)
    if reply.status == "lost":
        raise ClientError("the connection was lost while the answer was written")
    return 1 if reply.status == "failed" else 0


def _open_source(source: str, stdin: IO[str]) -> IO[str]:
    if source == "-":
        return stdin
    try:
        return open(source, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ClientError(f"cannot read {source}: {exc.strerror or exc}") from exc
