"""Live sessions of the daemon: creation, storage, resume, and the engine calls behind them.

Owns the map of sessions the daemon holds (attached to sockets or idle),
their protocol-level state (instructions, open item, running response), and
keeping the store and the engine in step: a session is stored on its first
item or update; a resumed one comes back from memory or is rebuilt from its
transcript. Knows nothing about websockets or frames.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from streamchat.engine.async_engine import AsyncEngine
from streamchat.server.events import new_id, session_object
from streamchat.store import AsyncStore, hash_token, new_resume_token, verify_token

log = logging.getLogger(__name__)


class SessionNotFound(Exception):
    """Unknown id or wrong token: the two are indistinguishable by design."""


@dataclass
class LiveSession:
    id: str
    token_hash: str
    resume_token: str | None = None  # shown once, at creation
    instructions: str = ""
    max_output_tokens: int | str = "inf"
    stored: bool = False
    last_item_id: str | None = None
    open_item_id: str | None = None
    response_id: str | None = None
    response_owner: object = None  # the connection that asked for the running response
    attached: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Hub:
    """Every live session, shared by all connections of the daemon."""

    def __init__(self, engine: AsyncEngine, store: AsyncStore, model_name: str, cache_cfg) -> None:
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.cache_cfg = cache_cfg
        self.sessions: dict[str, LiveSession] = {}

    def describe(self, s: LiveSession, with_token: bool = False) -> dict:
        return session_object(
            session_id=s.id, model=self.model_name, instructions=s.instructions,
            max_output_tokens=s.max_output_tokens,
            truncation={"sink_tokens": self.cache_cfg.sink_tokens,
                        "window_tokens": self.cache_cfg.window_tokens,
                        "block_size": self.cache_cfg.block_size},
            resume_token=s.resume_token if with_token else None)

    async def create(self) -> LiveSession:
        token = new_resume_token()
        s = LiveSession(new_id("sess"), hash_token(token), token)
        await self.engine.call(self.engine.engine.open_session, s.id, "")
        self.sessions[s.id] = s
        return s

    async def ensure_stored(self, s: LiveSession) -> None:
        if not s.stored:
            await self.store.create_session(s.id, s.token_hash, s.instructions, self._settings(s))
            s.stored = True

    def _settings(self, s: LiveSession) -> dict:
        return {"max_output_tokens": s.max_output_tokens, "sink_tokens": self.cache_cfg.sink_tokens,
                "window_tokens": self.cache_cfg.window_tokens, "block_size": self.cache_cfg.block_size}

    async def update(self, s: LiveSession, instructions: str | None, max_output_tokens) -> None:
        if instructions is not None and instructions != s.instructions:
            await self.engine.call(self.engine.engine.set_instructions, s.id, instructions)
            s.instructions = instructions
        if max_output_tokens is not None:
            s.max_output_tokens = max_output_tokens
        if s.stored:
            await self.store.update_session(s.id, instructions=s.instructions, settings=self._settings(s))
        else:
            await self.ensure_stored(s)

    async def resume(self, session_id: str, token: str) -> tuple[LiveSession, str]:
        """The session and where it came from: memory or transcript."""
        live = self.sessions.get(session_id)
        if live is not None:
            if not (live.stored and verify_token(token, live.token_hash)):
                raise SessionNotFound
            return live, "memory"
        record = await self.store.get_session(session_id)
        if record is None or not verify_token(token, record.token_hash):
            raise SessionNotFound
        items = await self.store.items(session_id)
        s = LiveSession(record.id, record.token_hash, None, record.instructions,
                        record.settings.get("max_output_tokens", "inf"), stored=True)
        s.last_item_id = items[-1].item_id if items else None
        open_items = [i for i in items if i.status == "in_progress" and i.kind == "append"]
        s.open_item_id = open_items[-1].item_id if open_items else None
        await self._close_interrupted(items)
        messages = [(i.role, i.text, i.item_id != s.open_item_id) for i in items if i.text or i.kind != "response"]
        await self.engine.call(self.engine.engine.restore_session, s.id, s.instructions, messages)
        self.sessions[s.id] = s
        return s, "transcript"

    async def _close_interrupted(self, items) -> None:
        """Responses that were running when the daemon died are stored incomplete."""
        for item in items:
            if item.kind == "response" and item.status == "in_progress":
                await self.store.finish_item(item.session_id, item.item_id, status="incomplete")

    async def detach(self, s: LiveSession) -> None:
        """A connection let go of the session; an unstored session with nobody left is dropped."""
        s.attached -= 1
        if s.attached <= 0 and not s.stored:
            self.sessions.pop(s.id, None)
            await self.engine.call(self.engine.engine.close_session, s.id)
