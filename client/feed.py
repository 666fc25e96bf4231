"""`streamchat feed`: streams a text source into a session as it arrives.

Lines are sent with `streamchat.input_text.append`, waiting for each
`appended` answer (which keeps the text in order and paces the feed). Lines
that have already arrived when an append is sent go into that one append, up
to `max_append_chars`, so a file is fed in large pieces while a live source
is still sent line by line as it comes. A blank line, or `commit_idle_s`
without input, closes the open item with `streamchat.input_text.commit`.
Progress goes to stderr; with `ask`, a question is asked at the end and the
answer printed on stdout. A new session's id is printed on stdout first and
recorded in the session file, so `chat` can `/resume` it. Knows nothing of
prompts.
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
from .controls import escape_controls
from .errors import ClientError, ConnectionLost, DaemonNotRunning, ServerError
from .lines import LineSource
from .render import PlainRenderer
from .reply import Renderer, stream_reply
from .sessions import SavedSession, SessionStore

log = logging.getLogger(__name__)

# About 2,000 tokens: well under the daemon's default text (200,000 characters)
# and frame (1 MiB) limits; an append the daemon finds too large is split.
MAX_APPEND_CHARS = 8000


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
    max_append_chars: int = MAX_APPEND_CHARS  # lines already read are sent together up to this
    commit_timeout_s: float = 600.0  # a commit waits for the daemon to prefill the whole item
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
        self._shown = ""

    def appended(self, event: dict, lines: int = 1) -> None:
        self.lines += lines
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
        if self.live or self.text() != self._shown:
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
        self._shown = self.text()
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
                await self.append(self._batch(line, source))
            else:
                await self.commit()
        await self.commit()

    def _batch(self, first: str, source: LineSource) -> list[str]:
        """`first` and the non-blank lines that have already arrived, up to the size limit."""
        lines, size = [first], len(first)
        while True:
            try:
                line = source.get_nowait()
            except asyncio.QueueEmpty:
                return lines
            if line is None or not line.strip() or size + len(line) > self.config.max_append_chars:
                source.unget(line)
                return lines
            lines.append(line)
            size += len(line)

    async def append(self, lines: list[str]) -> None:
        """Sends `lines` as one append (or, if the daemon finds that too large, several)."""
        events = await self._append_text("".join(lines))
        tokens = sum(int(event.get("tokens") or 0) for event in events)
        self.progress.appended({**events[-1], "tokens": tokens}, len(lines))

    async def _append_text(self, text: str) -> list[dict]:
        try:
            event = await self.call("streamchat.input_text.append",
                                    "streamchat.input_text.appended", text=text)
        except ServerError as exc:
            if exc.code != "message_too_large" or len(text) < 2:
                raise
            # Nothing was appended: send it in two halves, cut at a line break if there is one.
            cut = text.rfind("\n", 0, len(text) // 2) + 1 or len(text) // 2
            log.info("an append of %d characters was too large; splitting it", len(text))
            return [*await self._append_text(text[:cut]), *await self._append_text(text[cut:])]
        self.open_item = True
        return [event]

    async def commit(self) -> None:
        if not self.open_item:
            return
        await self.call("streamchat.input_text.commit", "conversation.item.done",
                        timeout_s=self.config.commit_timeout_s)
        self.open_item = False
        self.progress.committed()
        self.progress.stats(await self.call("streamchat.session.stats", "streamchat.session.stats"))

    async def call(self, type_: str, expect: str, timeout_s: float | None = None,
                   **fields: object) -> dict:
        """A request; after a lost connection, reconnects (resuming) and sends it again."""
        try:
            return await self.conn.request(type_, expect, timeout_s=timeout_s, **fields)
        except ConnectionLost as exc:
            log.info("%s; reconnecting", exc)
            await self._reconnect()
            return await self.conn.request(type_, expect, timeout_s=timeout_s, **fields)

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
        print(escape_controls(conn.session_id), file=stdout, flush=True)
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
