"""Live sessions of the daemon: creation, storage, resume, and the engine calls behind them.

Owns the map of sessions the daemon holds (attached to sockets or idle),
their protocol-level state (instructions, open item, running response), and
keeping the store and the engine in step: a session is stored on its first
item or update; a resumed one comes back from memory (prefetched from a lower
tier), from its saved file on disk, or is rebuilt from its transcript. It
also stamps saved files with the transcript they match (`transcript_mark`),
so a file the transcript has moved past is never used. Knows nothing about
websockets or frames.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

import time
from contextlib import asynccontextmanager

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.async_engine import AsyncEngine
from streamchat.model.sampling_params import SamplingParams, resolve_params
from streamchat.server.events import new_id, session_object
from streamchat.server.protocol import SESSION_SAMPLING_FIELDS
from streamchat.store import AsyncStore, hash_token, new_resume_token, verify_token
from streamchat.tiers import KVFileError

log = logging.getLogger(__name__)


class SessionNotFound(Exception):
    """Unknown id or wrong token: the two are indistinguishable by design."""


def transcript_mark(instructions: str, items) -> str:
    """Names the stored state of a session: its instructions and every item's id, status, size.

    A saved KV file carries the mark of the transcript it was taken from; a
    resume uses the file only when the store still gives the same mark.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(instructions.encode())
    for i in items:
        h.update(f"\0{i.item_id}\0{i.kind}\0{i.status}\0{len(i.text)}\0{i.num_tokens}".encode())
    return h.hexdigest()


def transcript_messages(items, open_item_id: str | None) -> tuple:
    """The engine's view of a stored transcript: (role, text, closed) per item, empty replies left out."""
    return tuple((i.role, i.text, i.item_id != open_item_id) for i in items if i.text or i.kind != "response")


@dataclass
class LiveSession:
    id: str
    token_hash: str
    resume_token: str | None = None  # shown once, at creation
    instructions: str = ""
    max_output_tokens: int | str = "inf"
    sampling: dict = field(default_factory=dict)  # the session's own sampling defaults (session.update)
    stored: bool = False
    last_item_id: str | None = None
    open_item_id: str | None = None
    open_item_chars: int = 0  # characters appended to the open item by this daemon
    response_id: str | None = None
    response_owner: object = None  # the connection that asked for the running response
    attached: int = 0
    detached_at: float = 0.0  # when the last connection let go (monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Hub:
    """Every live session, shared by all connections of the daemon."""

    def __init__(self, engine: AsyncEngine, store: AsyncStore, model_name: str, cache_cfg,
                 model_defaults: SamplingParams = SamplingParams()) -> None:
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.cache_cfg = cache_cfg
        self.model_defaults = model_defaults  # what a field neither the response nor the session sets takes
        self.sessions: dict[str, LiveSession] = {}
        self._resuming: dict[str, tuple[asyncio.Lock, int]] = {}  # one restore at a time per id, and its users
        self.submit = engine.submit

    def describe(self, s: LiveSession, with_token: bool = False) -> dict:
        return session_object(
            session_id=s.id, model=self.model_name, instructions=s.instructions,
            max_output_tokens=s.max_output_tokens, sampling=self.session_sampling(s),
            truncation={"sink_tokens": self.cache_cfg.sink_tokens,
                        "window_tokens": self.cache_cfg.window_tokens,
                        "block_size": self.cache_cfg.block_size},
            resume_token=s.resume_token if with_token else None)

    def session_sampling(self, s: LiveSession | None = None) -> dict:
        """A session's effective sampling defaults: its own over the model's (None: a new session's)."""
        params = resolve_params(self.model_defaults, s.sampling if s else {}, {})
        return {name: getattr(params, name) for name in SESSION_SAMPLING_FIELDS}

    def response_params(self, s: LiveSession, fields: dict) -> SamplingParams:
        """What one response samples with: its fields, else the session's, else the model's."""
        return self._resolve(s.sampling, fields)

    def _resolve(self, session_defaults: dict, fields: dict) -> SamplingParams:
        try:
            return resolve_params(self.model_defaults, session_defaults, fields)
        except ValueError as exc:
            raise EngineError("invalid_event", str(exc)) from None

    async def create(self) -> LiveSession:
        token = new_resume_token()
        s = LiveSession(new_id("sess"), hash_token(token), token)
        await self.submit(api.OpenSession(s.id, ""))
        self.sessions[s.id] = s
        return s

    async def ensure_stored(self, s: LiveSession) -> None:
        if not s.stored:
            await self.store.create_session(s.id, s.token_hash, s.instructions, self._settings(s))
            s.stored = True

    def _settings(self, s: LiveSession) -> dict:
        return {"max_output_tokens": s.max_output_tokens, "sampling": dict(s.sampling), "sink_tokens": self.cache_cfg.sink_tokens,
                "window_tokens": self.cache_cfg.window_tokens, "block_size": self.cache_cfg.block_size}

    async def update(self, s: LiveSession, instructions: str | None, max_output_tokens,
                     sampling: dict | None = None) -> None:
        """Stored first; then the engine takes the new prompt (rebuilt from the store if it fails).

        `sampling`: sampling defaults to set (SamplingParams names; others kept); a value
        out of range is `invalid_event` and changes nothing.
        """
        new_instructions = instructions if instructions is not None else s.instructions
        new_max = max_output_tokens if max_output_tokens is not None else s.max_output_tokens
        new_sampling = {**s.sampling, **(sampling or {})}
        self._resolve(new_sampling, {})  # refuses a value out of range before anything changes
        old = (s.instructions, s.max_output_tokens, s.sampling)
        s.instructions, s.max_output_tokens, s.sampling = new_instructions, new_max, new_sampling
        try:
            if s.stored:
                await self.store.update_session(s.id, instructions=s.instructions, settings=self._settings(s))
            else:
                await self.ensure_stored(s)
        except BaseException:
            s.instructions, s.max_output_tokens, s.sampling = old
            raise
        if new_instructions != old[0]:
            try:
                await self.submit(api.SetInstructions(s.id, new_instructions))
            except Exception:
                await self.rebuild(s)
                raise

    async def queue(self, s: LiveSession, prepared: api.Prepared, ticket=None) -> int:
        """Queue work the store already holds; if the engine fails, the session is rebuilt from
        the store, so its context never lacks what was acknowledged."""
        try:
            return await self.submit(api.Queue(prepared, ticket))
        except Exception:
            await self.rebuild(s)
            if ticket is not None and not ticket.done():
                ticket.set_result(0)
            raise

    async def commit_text(self, s: LiveSession, ticket) -> None:
        try:
            await self.submit(api.CommitText(s.id, ticket))
        except Exception:
            await self.rebuild(s)
            if not ticket.done():
                ticket.set_result(0)
            raise

    async def start_response(self, cmd: api.StartResponse) -> asyncio.Queue:
        """Start a reply; the queue of its TextDelta events and its ResponseFinished.

        The caller closes the stream (`engine.close_stream`) when it is done with it.
        """
        stream = self.engine.open_stream(cmd.response_id)
        try:
            await self.submit(cmd)
        except BaseException:
            self.engine.close_stream(cmd.response_id)
            raise
        return stream

    @asynccontextmanager
    async def ephemeral(self, instructions: str, messages: tuple[api.Message, ...]):
        """A session for one stateless request (the HTTP API): built from the messages the
        client sent, its id yielded, closed on exit. Never stored: the client holds the
        conversation, and the prefix cache, not a transcript, makes its next request cheap.
        Refused `overloaded` past the daemon's pending limit."""
        session_id = new_id("http")
        await self.submit(api.RestoreTranscript(session_id, instructions, messages, admit=True))
        try:
            yield session_id
        finally:
            try:
                await self.submit(api.CloseSession(session_id))
            except Exception:
                log.exception("could not close the stateless session %s", session_id)

    async def rebuild(self, s: LiveSession) -> None:
        """The engine's copy of the session is not trusted: build it again from the store."""
        log.warning("session %s: rebuilding its context from the transcript", s.id)
        try:
            await self.submit(api.CloseSession(s.id))
            items = await self.store.items(s.id) if s.stored else []
            messages = transcript_messages(items, s.open_item_id)
            await self.submit(api.RestoreTranscript(s.id, s.instructions, messages))
        except Exception:
            log.exception("session %s: rebuild failed; it is rebuilt on its next resume", s.id)
            self.sessions.pop(s.id, None)

    async def resume(self, session_id: str, token: str) -> tuple[LiveSession, str]:
        """The session and where it came from: memory, disk or transcript.

        A session still in the daemon is prefetched to the device from a
        lower tier before this returns, so its first item finds it there.
        """
        async with self._id_lock(session_id):
            return await self._resume(session_id, token)

    @asynccontextmanager
    async def _id_lock(self, session_id: str):
        """One restore or release of a session id at a time (counted, so the map stays small)."""
        lock, users = self._resuming.get(session_id, (asyncio.Lock(), 0))
        self._resuming[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._resuming[session_id]
            if users == 1:
                del self._resuming[session_id]
            else:
                self._resuming[session_id] = (lock, users - 1)

    async def _resume(self, session_id: str, token: str) -> tuple[LiveSession, str]:
        live = self.sessions.get(session_id)
        if live is not None:
            if not (live.stored and verify_token(token, live.token_hash)):
                raise SessionNotFound
            origin = await self.submit(api.Prefetch(session_id))
            return live, "disk" if origin == "disk" else "memory"
        record = await self.store.get_session(session_id)
        if record is None or not verify_token(token, record.token_hash):
            raise SessionNotFound
        items = await self.store.items(session_id)
        mark = transcript_mark(record.instructions, items)
        s = LiveSession(record.id, record.token_hash, None, record.instructions,
                        record.settings.get("max_output_tokens", "inf"), self._stored_sampling(record), stored=True)
        s.last_item_id = items[-1].item_id if items else None
        open_items = [i for i in items if i.status == "in_progress" and i.kind == "append"]
        s.open_item_id = open_items[-1].item_id if open_items else None
        await self._close_interrupted(items)
        messages = transcript_messages(items, s.open_item_id)
        restored_from = "disk" if await self._restore_saved(s, messages, mark) else "transcript"
        if restored_from == "transcript":
            await self.submit(api.RestoreTranscript(s.id, s.instructions, messages))
        self.sessions[s.id] = s
        return s, restored_from

    def _stored_sampling(self, record) -> dict:
        """A stored session's sampling defaults; a field this daemon does not know, or one
        out of today's ranges, is dropped with a warning (the model's default applies)."""
        kept = {}
        for name, value in (record.settings.get("sampling") or {}).items():
            try:
                if name not in SESSION_SAMPLING_FIELDS:
                    raise ValueError("not a session sampling field")
                resolve_params(self.model_defaults, {name: value}, {})
            except ValueError as exc:
                log.warning("session %s: ignoring its stored sampling default %s=%r: %s", record.id, name, value, exc)
                continue
            kept[name] = value
        return kept

    async def _restore_saved(self, s: LiveSession, messages, mark: str) -> bool:
        """Load the session's saved KV if its file is whole, ours, and matches the transcript."""
        if not self.has_disk:
            return False
        try:  # read and checked off the engine thread: other sessions keep streaming
            snap = await self.submit(api.LoadSaved(s.id, mark))
            reason = await self.submit(api.RestoreSaved(s.id, s.instructions, messages, snap))
            if reason is not None:
                raise KVFileError(reason, "the saved KV does not fit this session now"
                                  if reason == "prompt" else "no room in the KV pool")
        except KVFileError as exc:
            log.warning("session %s: saved KV not used (%s); rebuilding it from the transcript", s.id, exc)
            return False
        log.info("session %s: KV loaded from disk (%d tokens)", s.id, len(snap.state.token_ids))
        return True

    async def checkpoint_idle(self, idle_s: float) -> int:
        """Save sessions idle for `idle_s` to disk with their transcript mark; returns how many."""
        saved = 0
        for sid in await self.submit(api.CheckpointCandidates(idle_s)):
            s = self.sessions.get(sid)
            if s is None or not s.stored or s.response_id is not None or s.lock.locked():
                continue
            async with s.lock:  # no event of this session runs: the store holds all it has seen
                if s.response_id is None:
                    mark = await self._mark(s)
                    saved += await self.submit(api.Checkpoint(sid, mark))
        return saved

    async def release_idle(self, idle_s: float) -> int:
        """Sessions no connection has held for `idle_s` leave memory (their KV to disk when it
        can go there); a later resume loads them from the store. Returns how many left."""
        now = time.monotonic()
        released = 0
        for s in list(self.sessions.values()):
            if s.attached > 0 or s.response_id is not None or now - s.detached_at < idle_s or s.lock.locked():
                continue
            async with self._id_lock(s.id), s.lock:
                if s.attached > 0 or s.response_id is not None or self.sessions.get(s.id) is not s:
                    continue
                mark = await self._mark(s) if self.has_disk else None
                if await self.submit(api.Release(s.id, mark)):
                    del self.sessions[s.id]
                    released += 1
        if released:
            log.info("%d idle sessions left memory; %d remain", released, len(self.sessions))
        return released

    @property
    def has_disk(self) -> bool:
        return self.engine.snapshot.tiers.get("disk") is not None

    async def persist_all(self, timeout_s: float = 10.0) -> int:
        """Shutdown: every stored session to disk, stamped with its transcript mark."""
        if not self.has_disk:
            return 0
        marks = {s.id: await self._mark(s) for s in list(self.sessions.values()) if s.stored}
        saved = await self.submit(api.Persist(marks, timeout_s), timeout_s=timeout_s + 5)
        log.info("saved %d of %d sessions to disk", saved, len(marks))
        return saved

    async def _mark(self, s: LiveSession) -> str:
        record = await self.store.get_session(s.id)
        return transcript_mark(record.instructions if record else s.instructions, await self.store.items(s.id))

    async def _close_interrupted(self, items) -> None:
        """Responses that were running when the daemon died are stored incomplete."""
        for item in items:
            if item.kind == "response" and item.status == "in_progress":
                await self.store.finish_item(item.session_id, item.item_id, status="incomplete")

    async def detach(self, s: LiveSession) -> None:
        """A connection let go of the session; an unstored session with nobody left is dropped."""
        s.attached -= 1
        s.detached_at = time.monotonic()
        if s.attached <= 0 and not s.stored:
            self.sessions.pop(s.id, None)
            await self.submit(api.CloseSession(s.id))
