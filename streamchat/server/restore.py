"""Bringing sessions back: resume by id and token, after an engine core restart, and saving them for it.

Owns how a session comes back into an engine core: from memory (still
there, prefetched from a lower tier), from its saved file on disk (if the
file matches the stored transcript: `transcript_mark`), or rebuilt from the
transcript; doing so again, lazily, for every session the front holds once
the core has restarted (`ensure`); and the saves that make that exact:
checkpoints of idle sessions, releasing sessions nobody holds, and saving
all at shutdown. One restore or release of a session id at a time.

In a fleet (`server.fleet`) a session comes back from the store only under
its lease, taken before its transcript is read; a saved file is stamped
with the lease epoch it was written under (`transcript_mark@epoch`) and is
used only if that epoch is at least the one before this daemon's lease (the
last holder's or newer): a file an older holder wrote after it lost the
session is refused and the transcript rebuild applies. A session is saved
only while its lease is confirmed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from streamchat.engine import api
from streamchat.model.sampling_params import resolve_params
from streamchat.server.fleet import SessionLeased
from streamchat.server.protocol import SESSION_SAMPLING_FIELDS
from streamchat.store import UnknownSession, verify_token

if TYPE_CHECKING:
    from streamchat.server.sessions import Hub, LiveSession

log = logging.getLogger(__name__)
NOT_OPENED = -1  # LiveSession.epoch of a new session no engine core has opened yet (0: in none, maybe half-built)


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


class Restorer:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # one restore at a time per id, and its users

    @property
    def engine(self):
        return self.hub.engine

    def busy(self, session_id: str) -> bool:
        """A restore or release of the session is under way."""
        return session_id in self._locks

    @property
    def has_disk(self) -> bool:
        return self.engine.snapshot.tiers.get("disk") is not None

    @asynccontextmanager
    async def id_lock(self, session_id: str):
        """One restore or release of a session id at a time (counted, so the map stays small)."""
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users == 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    # -- into the engine core ------------------------------------------------------------

    async def ensure(self, s: LiveSession) -> str | None:
        """Make sure `s` is open in the engine core that runs now; where it came from, if it had to
        come back (the core restarted since it was opened), else None (a new session entering it)."""
        if self.engine.restarting:  # the epoch advances only as the next core starts: compare after that
            await self.engine.wait_ready()
        if s.epoch == self.engine.epoch:
            return None
        async with self.id_lock(s.id):
            if s.epoch == self.engine.epoch:
                return None
            await self.engine.wait_ready()
            epoch, new = self.engine.epoch, s.epoch == NOT_OPENED
            restored_from = await self._reopen(s)
            s.epoch = epoch
            if new:
                return None
            log.info("session %s is back in the restarted engine (from %s)", s.id, restored_from)
            return restored_from

    async def _reopen(self, s: LiveSession) -> str:
        hub = self.hub
        if s.epoch != NOT_OPENED:
            await hub.submit(api.CloseSession(s.id, keep_saved=True))  # nothing there, unless half restored
        if not s.stored:  # a new session, or one not stored yet
            await hub.submit(api.OpenSession(s.id, await hub.tokens(hub.chat.system_prefix, s.instructions)))
            return "transcript"
        items = await hub.store.items(s.id)
        return await self._open_stored(s, items)

    async def _open_stored(self, s: LiveSession, items) -> str:
        """Open a stored session in the engine: from its file if current, else its transcript."""
        hub = self.hub
        messages = transcript_messages(items, s.open_item_id)
        prefix = await hub.tokens(hub.chat.system_prefix, s.instructions)
        open_item = s.open_item_id is not None
        if self.has_disk:
            epoch = self.hub.fleet.epoch_of(s.id) or 0
            mark = f"{transcript_mark(s.instructions, items)}@{max(0, epoch - 1)}"  # the last holder's or newer
            reason = await hub.submit(api.RestoreSaved(s.id, prefix, mark, open_item, len(messages)))
            if reason is None:
                log.info("session %s: KV loaded from disk", s.id)
                return "disk"
            log.warning("session %s: saved KV not used (%s); rebuilding it from the transcript", s.id, reason)
        body = await hub._transcript(messages)
        await hub.submit(api.RestoreTranscript(s.id, prefix, body, open_item, len(messages)))
        return "transcript"

    async def rebuild(self, s: LiveSession) -> None:
        """The engine's copy of the session is not trusted: build it again from the store."""
        log.warning("session %s: rebuilding its context from the transcript", s.id)
        hub = self.hub
        try:
            await hub.submit(api.CloseSession(s.id))
            items = await hub.store.items(s.id) if s.stored else []
            messages = transcript_messages(items, s.open_item_id)
            prefix = await hub.tokens(hub.chat.system_prefix, s.instructions)
            await hub.submit(api.RestoreTranscript(s.id, prefix, await hub._transcript(messages),
                                                   s.open_item_id is not None, len(messages)))
        except Exception:
            # still attached, maybe: kept, and marked as in no core, so its next call reopens it from the store
            log.exception("session %s: rebuild failed; it is rebuilt on its next call", s.id)
            s.epoch = 0

    # -- resume ---------------------------------------------------------------------------

    async def resume(self, session_id: str, token: str) -> tuple[LiveSession, str]:
        """The session and where it came from: memory, disk or transcript.

        A session still in the daemon is prefetched to the device from a
        lower tier before this returns, so its first item finds it there.
        """
        live = self.hub.sessions.get(session_id)
        if live is not None:
            if not (live.stored and verify_token(token, live.token_hash)):
                raise SessionNotFound
            if not self.hub.fleet.holds(session_id):  # lost to another daemon; being dropped here
                raise SessionLeased(session_id, None)
            came_back = await self.ensure(live)
            if came_back is not None:
                return live, came_back
            origin = await self.hub.submit(api.Prefetch(session_id))
            return live, "disk" if origin == "disk" else "memory"
        async with self.id_lock(session_id):
            return await self._resume_stored(session_id, token)

    async def _resume_stored(self, session_id: str, token: str) -> tuple[LiveSession, str]:
        hub = self.hub
        live = hub.sessions.get(session_id)  # resumed by another connection meanwhile
        if live is not None:
            if not (live.stored and verify_token(token, live.token_hash)):
                raise SessionNotFound
            return live, "memory"
        try:  # read under the lease: no earlier holder can write after it
            record, items = await hub.fleet.take_session(session_id, lambda r: verify_token(token, r.token_hash))
        except UnknownSession:  # none, or the wrong token: no lease taken
            raise SessionNotFound from None
        try:
            return await self._open_leased(record, items)
        except BaseException:
            await hub.fleet.release(session_id)
            raise

    async def _open_leased(self, record, items) -> tuple[LiveSession, str]:
        """Open a stored session whose lease this daemon has just taken, as the store held it then."""
        from streamchat.server.sessions import LiveSession

        hub = self.hub
        s = LiveSession(record.id, record.token_hash, None, record.instructions,
                        record.settings.get("max_output_tokens", "inf"), self._stored_sampling(record), stored=True)
        s.last_item_id = items[-1].item_id if items else None
        open_items = [i for i in items if i.status == "in_progress" and i.kind == "append"]
        s.open_item_id = open_items[-1].item_id if open_items else None
        items = await self._close_interrupted(items)
        await self.engine.wait_ready()
        epoch = self.engine.epoch
        restored_from = await self._open_stored(s, items)
        s.epoch = epoch
        hub.sessions[s.id] = s
        return s, restored_from

    def _stored_sampling(self, record) -> dict:
        """A stored session's sampling defaults; a field this daemon does not know, or one
        out of today's ranges, is dropped with a warning (the model's default applies)."""
        kept = {}
        for name, value in (record.settings.get("sampling") or {}).items():
            try:
                if name not in SESSION_SAMPLING_FIELDS:
                    raise ValueError("not a session sampling field")
                resolve_params(self.hub.model_defaults, {name: value}, {})
            except ValueError as exc:
                log.warning("session %s: ignoring its stored sampling default %s=%r: %s", record.id, name, value, exc)
                continue
            kept[name] = value
        return kept

    async def _close_interrupted(self, items):
        """Responses that were running when the daemon died are stored incomplete; the items as now."""
        changed = False
        for item in items:
            if item.kind == "response" and item.status == "in_progress":
                await self.hub.store.finish_item(item.session_id, item.item_id, status="incomplete")
                changed = True
        return await self.hub.store.items(items[0].session_id) if changed else items

    # -- saving ---------------------------------------------------------------------------

    async def checkpoint_idle(self, idle_s: float) -> int:
        """Save sessions idle for `idle_s` to disk with their transcript mark; returns how many."""
        hub = self.hub
        saved = 0
        for sid in await hub.submit(api.CheckpointCandidates(idle_s)):
            s = hub.sessions.get(sid)
            if s is None or not s.stored or s.response_id is not None or s.lock.locked():
                continue
            async with s.lock:  # no event of this session runs: the store holds all it has seen
                if s.response_id is None and s.epoch == self.engine.epoch:
                    mark = await self.mark(s)
                    saved += mark is not None and await hub.submit(api.Checkpoint(sid, mark))
        return saved

    async def release_idle(self, idle_s: float) -> int:
        """Sessions no connection has held for `idle_s` leave memory (their KV to disk when it
        can go there); a later resume loads them from the store. Returns how many left."""
        hub = self.hub
        now = time.monotonic()
        released = 0
        for s in list(hub.sessions.values()):
            if s.attached > 0 or s.response_id is not None or now - s.detached_at < idle_s or s.lock.locked():
                continue
            async with self.id_lock(s.id), s.lock:
                if s.attached > 0 or s.response_id is not None or hub.sessions.get(s.id) is not s:
                    continue
                if s.epoch != self.engine.epoch:  # not in the engine that runs now: nothing to save
                    if s.epoch == 0:  # a failed rebuild may have left a copy there
                        await hub.submit(api.CloseSession(s.id, keep_saved=True))
                    del hub.sessions[s.id]
                    released += 1
                    continue
                mark = await self.mark(s) if self.has_disk else None
                if self.has_disk and mark is None:  # lost to another daemon: dropped without a save
                    continue
                if await hub.submit(api.Release(s.id, mark)):
                    del hub.sessions[s.id]
                    await hub.fleet.release(s.id)  # after its save was queued (written moments later)
                    released += 1
        if released:
            log.info("%d idle sessions left memory; %d remain", released, len(hub.sessions))
        return released

    async def persist_all(self, timeout_s: float = 10.0) -> int:
        """Shutdown: every stored session to disk, stamped with its transcript mark."""
        if not self.has_disk:
            return 0
        hub = self.hub
        live = [s for s in list(hub.sessions.values()) if s.stored and s.epoch == self.engine.epoch]
        marks = {s.id: mark for s in live if (mark := await self.mark(s)) is not None}
        saved = await hub.submit(api.Persist(marks, timeout_s), timeout_s=timeout_s + 5)
        log.info("saved %d of %d sessions to disk", saved, len(marks))
        return saved

    async def mark(self, s: LiveSession) -> str | None:
        """What a save of `s` is stamped with (`transcript_mark@lease epoch`); None once its lease is lost."""
        fleet = self.hub.fleet
        if not await fleet.confirm(s.id):
            return None
        record, items = await self.hub.store.session_with_items(s.id)
        return f"{transcript_mark(record.instructions, items)}@{fleet.epoch_of(s.id) or 0}"
