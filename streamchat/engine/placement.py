"""Where every session's KV lives, and every move between tiers: the scheduler's memory half.

Owns `EngineSession.residency` (nothing else assigns it) and each decision
about a session's memory: which idle session leaves the device pool and for
which tier, bringing one back (room is made first, then the pager copies:
nothing calls back up), reading a file on the disk tier's reader thread and
landing it between steps, saved copies and their transcript marks. The
pager moves bytes and returns values; it changes no session.

    device --page_out--> host (room, or the host's oldest go to disk first) | disk | dropped
    host --wake--> device (copied back between steps)
    disk --wake--> [reader thread: read, check] --take_loads--> device (landed between steps)
    dropped --wake--> device, rebuilt by prefill from its tokens

`sync_io`: in-process engines (tests, the LLM class) read files inline; the
engine core reads them on the reader thread, so a step never waits on a disk.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from streamchat.engine.session import EngineSession, Pending, Residency
from streamchat.tiers.kvfile import ANY_MARK, KVFileError, Snapshot
from streamchat.tiers.pager import Pager, state_of

log = logging.getLogger(__name__)

DEVICE, HOST, DISK, DROPPED = Residency.DEVICE, Residency.HOST, Residency.DISK, Residency.DROPPED


class Placer:
    def __init__(self, manager, pager: Pager | None, sessions: dict[str, EngineSession], stats,
                 sync_io: bool = True, activate: Callable[[EngineSession], None] = lambda s: None) -> None:
        self.manager, self.pager, self.sync_io = manager, pager, sync_io
        self.sessions = sessions  # the engine's table of sessions (read here, never added to)
        self.stats = stats  # the scheduler's: idle drops
        self.activate = activate  # the scheduler's: a session given work here is stepped
        self.notify: Callable[[], None] = lambda: None  # wakes the core's loop when a read finished
        self._loads: dict[str, int] = {}  # session id -> the read in flight for it
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (session id, read no, then, result)
        self._reads = 0  # reads started
        self._coming_up: str | None = None  # a session landing from the host: its copy must stay there

    # -- saved copies ---------------------------------------------------------------------

    @staticmethod
    def changed(s: EngineSession) -> None:
        s.kv_version += 1  # saved copies of the old context are no longer current
        s.transcript_mark = None

    def on_disk(self, s: EngineSession) -> bool:
        return self.pager is not None and self.pager.on_disk(s.session_id, s.kv_version)

    @property
    def has_disk(self) -> bool:
        return self.pager is not None and self.pager.disk is not None

    # -- room and going down --------------------------------------------------------------

    def make_room(self, num_blocks: int, me: EngineSession | None, scheduled=()) -> bool:
        """True once `num_blocks` blocks are free; idle sessions give theirs up, least recent first."""
        while self.manager.pool.num_free < num_blocks:
            victim = self.idle_victim(me, scheduled)
            if victim is None:
                return False
            self.drop(victim)
        return True

    def idle_victim(self, me, scheduled) -> EngineSession | None:
        # A session whose last pending chunk is in this step is idle now, but its blocks are
        # written by this step: freeing them could hand them to another chunk of the step.
        idle = [v for v in self.sessions.values() if v is not me and v.resident and v.seq.block_ids
                and not v.busy and not any(v is o for o in scheduled)]
        return min(idle, key=lambda v: v.last_active, default=None)

    def drop(self, s: EngineSession) -> None:
        """Give up the session's blocks: an idle one moves down a tier if one takes it, else
        (and a busy one always) keeps only its tokens, rebuilt when next needed."""
        if not s.busy and self.page_out(s):
            log.debug("session %s moved to the %s tier", s.session_id, s.residency)
            return
        tokens = list(s.seq.token_ids)
        self.manager.free(s.seq)
        s.seq = self.manager.new_seq(s.pinned_tokens, s.seq.eviction)
        if s.busy:
            s.pending.appendleft(Pending(tokens))
        else:
            s.residency, s.dropped_tokens, s.parked = DROPPED, tokens, None
            self.stats.idle_drops += 1
        log.debug("session %s gave up its blocks (%d tokens)", s.session_id, len(tokens))

    def page_out(self, s: EngineSession) -> bool:
        """Move an idle resident session's blocks down a tier; False if no tier takes it."""
        if self.pager is None:
            return False
        seq = s.seq
        state = state_of(seq, s.pinned_tokens, s.total_tokens)
        target = self._place(s, state)
        if target is None:
            return False
        self.manager.free(seq)
        s.seq = self.manager.new_seq(s.pinned_tokens, seq.eviction)
        s.residency, s.dropped_tokens, s.parked = target, list(state.token_ids), state
        return True

    def _place(self, s: EngineSession, state) -> Residency | None:
        """Host if it has room; disk if it holds this state already; host after its oldest go to
        disk; disk; else nowhere."""
        p, seq, sid = self.pager, s.seq, s.session_id
        hashes = seq.block_hashes if seq.pristine else []
        if p.host_fits(state, hashes):
            p.to_host(sid, state, seq.block_ids, hashes)
            return HOST
        if p.on_disk(sid, s.kv_version):
            p.moves[(DEVICE, DISK)] += 1
            return DISK
        if p.host_could_fit(len(seq.block_ids)):
            while not p.host_fits(state, hashes) and (oldest := p.host_oldest(keep=self._coming_up)) is not None:
                self._host_to_disk(self.sessions[oldest])
            if p.host_fits(state, hashes):
                p.to_host(sid, state, seq.block_ids, hashes)
                return HOST
        if p.save_device(sid, state, seq.block_ids, s.kv_version, s.transcript_mark):
            p.moves[(DEVICE, DISK)] += 1
            return DISK
        return None

    def _host_to_disk(self, s: EngineSession) -> None:
        """The host's oldest session goes to disk (dropped to its tokens if disk cannot take it)."""
        p = self.pager
        to = DISK
        if not p.on_disk(s.session_id, s.kv_version):
            to = DISK if p.save_host(s.session_id, s.kv_version, s.transcript_mark) else DROPPED
        p.drop_host(s.session_id, to)
        s.residency = to
        if to is DROPPED:
            s.parked = None

    # -- coming back up -------------------------------------------------------------------

    def wake(self, s: EngineSession) -> None:
        """Its context is about to change: bring its KV back up (a file: read off the loop)."""
        self.changed(s)
        self.prefetch(s)

    def prefetch(self, s: EngineSession) -> None:
        """Bring the KV up: from the host now, from disk once read, or rebuild from its tokens."""
        if s.resident or s.loading:
            return
        if s.residency is HOST and self._land_host(s):
            return
        if s.residency is DISK:
            self.read(s.session_id, ANY_MARK, lambda result: self._landed_file(s, result))
            s.loading = s.session_id in self._loads
            return
        self._rebuild_from_tokens(s)

    def _land_host(self, s: EngineSession) -> bool:
        p = self.pager
        plan = p.plan_in(s.parked)
        self._coming_up = s.session_id
        try:
            room = self.make_room(len(plan.missing), s)
        finally:
            self._coming_up = None
        if not room:
            p.abort(plan)
            return False
        s.seq = p.land_host(plan, s.session_id)
        s.residency, s.dropped_tokens, s.parked = DEVICE, [], None
        return True

    def _landed_file(self, s: EngineSession, result) -> None:
        s.loading = False
        if self.sessions.get(s.session_id) is not s or s.residency is not DISK:
            return  # closed or rebuilt while its file was read
        if not isinstance(result, KVFileError) and result.state.token_ids != s.dropped_tokens:
            self.pager.note_failure("inconsistent")
            result = KVFileError("inconsistent", "its tokens are not the session's")
        if isinstance(result, KVFileError) or not self.land_file(s, result):
            log.warning("session %s: saved KV not used (%s); rebuilding it from its tokens", s.session_id,
                        result if isinstance(result, KVFileError) else "no room in the KV pool")
            self._rebuild_from_tokens(s)

    def land_file(self, s: EngineSession, snap: Snapshot) -> bool:
        """Copy a loaded file into fresh device blocks (room made first); False if no room."""
        p = self.pager
        plan = p.plan_in(snap.state)
        if not self.make_room(len(plan.missing), s):
            p.abort(plan)
            return False
        s.seq = p.land_snapshot(plan, snap)
        s.residency, s.dropped_tokens, s.parked = DEVICE, [], None
        return True

    def _rebuild_from_tokens(self, s: EngineSession) -> None:
        self._discard(s)
        if s.dropped_tokens:
            s.pending.appendleft(Pending(s.dropped_tokens))
            self.activate(s)
        s.residency, s.dropped_tokens = DEVICE, []

    # -- file reads -----------------------------------------------------------------------

    def read(self, session_id: str, mark, then: Callable) -> None:
        """Read and check a session's file; `then(Snapshot | KVFileError)` runs on the engine's
        thread: inline (sync_io), or from `take_loads` once the reader thread is done."""
        p = self.pager
        if p is None or p.disk is None:
            then(KVFileError("missing", "no disk tier"))
            return
        if self.sync_io:
            try:
                result = p.disk.load(session_id, mark)
            except KVFileError as exc:
                p.note_failure(exc.reason)
                result = exc
            then(result)
            return
        self._reads += 1
        number = self._reads
        self._loads[session_id] = number

        def done(result) -> None:  # on the reader thread
            self._done.put((session_id, number, then, result))
            self.notify()

        p.load_async(session_id, mark, done)

    def take_loads(self) -> int:
        """Finish the reads the reader thread completed (on the engine's thread); how many."""
        n = 0
        while True:
            try:
                session_id, number, then, result = self._done.get_nowait()
            except queue.Empty:
                return n
            if self._loads.get(session_id) == number:
                del self._loads[session_id]
                then(result)
                n += 1

    @property
    def reading(self) -> bool:
        return bool(self._loads)

    # -- context changes and the end ------------------------------------------------------

    def reset(self, s: EngineSession, pinned_tokens: int, prefix: list[int]) -> None:
        """A new pinned prefix: every position's KV changes, so the context is rebuilt behind it.

        Queued entries keep their tickets (each is reported once its tokens are in).
        """
        tail = (list(s.seq.token_ids) if s.resident else list(s.dropped_tokens))[s.pinned_tokens:]
        self._discard(s)  # nothing to page in: the saved KV is of the old prefix
        self.manager.free(s.seq)
        s.pinned_tokens = pinned_tokens
        s.seq = self.manager.new_seq(pinned_tokens, s.seq.eviction)
        s.residency, s.dropped_tokens = DEVICE, []
        queued = [Pending(p.token_ids[p.done:], p.ticket, p.starts_response) for p in s.pending]
        s.pending.clear()
        s.pending.append(Pending(prefix + tail))
        s.pending.extend(queued)
        self.activate(s)

    def rebuild(self, s: EngineSession) -> None:
        """Recompute the session's KV from its tokens (after a failed step: its cache is not trusted)."""
        if not s.resident:
            return
        tokens = list(s.seq.token_ids)
        self.manager.free(s.seq)
        s.seq = self.manager.new_seq(s.pinned_tokens, s.seq.eviction)
        if tokens:
            s.pending.appendleft(Pending(tokens))

    def forget(self, s: EngineSession, delete_file: bool) -> None:
        """The session is closed: its host copy and read go (its file too, if asked), its blocks are freed."""
        self._discard(s)
        if delete_file and self.pager is not None:
            self.pager.delete_file(s.session_id)
        self.manager.free(s.seq)

    def _discard(self, s: EngineSession) -> None:
        if self.pager is not None:
            self.pager.drop_host(s.session_id)
        self._loads.pop(s.session_id, None)
        s.parked, s.loading = None, False

    def check(self) -> None:
        """Assert every session's residency agrees with where its KV is."""
        for s in self.sessions.values():
            if not s.resident:
                assert not s.seq.block_ids, (s.session_id, s.residency)
                assert s.parked is not None or s.residency is DROPPED, (s.session_id, s.residency)
            assert s.loading == (s.session_id in self._loads), s.session_id
        if self.pager is not None:
            self.pager.check({s.session_id for s in self.sessions.values() if s.residency is HOST})
