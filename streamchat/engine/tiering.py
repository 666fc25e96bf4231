"""The engine's requests about tiers: prefetch, restore from a saved file, checkpoint, release.

Owns the request-side policy around the pager (which the scheduler owns and
which alone moves KV between tiers): when a session is prefetched, when a
saved copy is current (`kv_version`, `transcript_mark`), which idle sessions
are worth a checkpoint, and moving an idle session out of memory entirely.
Runs on the engine thread, like the engine.
"""

from __future__ import annotations

import time

from streamchat.engine.api import EngineError
from streamchat.engine.session import EngineSession, Residency
from streamchat.tiers import kvfile


class Tiering:
    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def pager(self):
        return self.engine.scheduler.pager

    @property
    def disk(self):
        return self.pager.disk if self.pager is not None else None

    # -- state of one session --------------------------------------------------------------

    @staticmethod
    def changed(s: EngineSession) -> None:
        s.kv_version += 1  # saved copies of the old context are no longer current
        s.transcript_mark = None

    @staticmethod
    def context_of(s: EngineSession) -> list[int]:
        return s.seq.token_ids if s.resident else s.dropped_tokens

    def on_disk(self, s: EngineSession) -> bool:
        return self.pager is not None and self.pager.on_disk(s)

    def wake(self, s: EngineSession) -> None:
        """Its context is about to change: bring its KV back up (or rebuild it)."""
        self.changed(s)
        self.engine.scheduler.wake(s, self._room_for(s))

    def _room_for(self, s: EngineSession):
        """make_free(n) for a page-in: idle sessions page down until n device blocks are free."""
        eng = self.engine
        return lambda n: eng.scheduler.make_free(n, list(eng.sessions.values()), s)

    # -- requests ----------------------------------------------------------------------------

    def prefetch(self, session_id: str) -> str:
        """A client attached: bring its KV up before its first item; the tier it came from.

        A session dropped to its tokens starts its rebuild now, in the background.
        """
        s = self.engine._get(session_id)
        origin = s.residency
        if origin in (Residency.HOST, Residency.DISK) and not s.busy and self.pager.page_in(s, self._room_for(s)):
            return origin.value
        if s.residency is Residency.DROPPED:  # never had a lower-tier copy, or its file was refused
            self.wake(s)
            return Residency.DROPPED.value
        return s.residency.value

    def load_saved(self, session_id: str, mark: str):
        """Read and check the session's file: a Snapshot (KVFileError if unusable). Thread-safe."""
        if self.disk is None:
            raise kvfile.KVFileError("missing", "no disk tier")
        try:
            return self.disk.load(session_id, mark)
        except kvfile.KVFileError as exc:
            self.pager.note_failure(exc.reason)
            raise

    def restore_saved(self, session_id: str, instructions: str, messages, snap) -> str | None:
        """Open a session from its saved KV; None on success, else why not (then it is not opened).

        `messages` are its transcript items as for `restore_session`, which
        give the chat state (open item, item count); the KV comes from `snap`.
        """
        eng = self.engine
        if session_id in eng.sessions:
            raise EngineError("invalid_event", f"session {session_id} is already open")
        state = snap.state
        prefix = eng._system_tokens(instructions)
        pinned = len(prefix) if eng.cache_cfg.pin_system_prompt else 0
        if state.token_ids[:len(prefix)] != prefix or state.pinned_tokens != pinned:
            self.pager.note_failure("prompt")
            return "prompt"
        s = EngineSession(session_id, eng.manager.new_seq(pinned), pinned, last_active=eng.clock())
        kv = eng.runner.kv_caches
        seq = self.pager.to_device(state, lambda rows, ids: kvfile.scatter(snap.tensors, rows, kv, ids),
                                   self._room_for(s))
        if seq is None:
            self.pager.note_failure("no_room")
            return "no_room"
        s.seq, s.total_tokens, s.transcript_mark = seq, state.total_tokens, snap.mark
        s.open_item = bool(messages) and not messages[-1][2]
        s.num_items = len(messages)
        eng.sessions[session_id] = s
        self.disk.adopt(session_id, s.kv_version)
        self.pager.moves[("disk", "device")] += 1
        return None

    def checkpoint_candidates(self, idle_s: float) -> list[str]:
        """Sessions idle for `idle_s` whose current state is not on disk with a transcript mark."""
        if self.disk is None:
            return []
        now = self.engine.clock()
        return [s.session_id for s in self.engine.sessions.values()
                if not s.busy and now - s.last_active >= idle_s and s.residency is not Residency.DROPPED
                and not (self.pager.on_disk(s) and s.transcript_mark is not None)]

    def checkpoint(self, session_id: str, mark: str) -> bool:
        """Save an idle session to disk, stamped with the transcript it matches."""
        s = self.engine.sessions.get(session_id)
        return s is not None and self.pager is not None and self.pager.checkpoint(s, mark)

    def release(self, session_id: str, mark: str | None) -> bool:
        """An idle session nobody holds leaves memory: saved to disk when it can be, then closed.

        With no file (no disk tier, or the save failed) a later resume rebuilds it
        from its transcript, which is the store's to keep.
        """
        s = self.engine.sessions.get(session_id)
        if s is None:
            return True
        if s.busy:
            return False
        saved = mark is not None and self.checkpoint(session_id, mark)
        self.engine.close_session(session_id, keep_saved=saved)
        return True

    def persist(self, marks: dict[str, str], timeout_s: float = 10.0) -> int:
        """Shutdown: finish queued prefill (until the deadline), then save the listed sessions."""
        if self.disk is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while self.engine.has_work() and time.monotonic() < deadline:
            self.engine.step()
        saved = sum(1 for sid, mark in marks.items()
                    if time.monotonic() < deadline and self.checkpoint(sid, mark))
        self.pager.flush()
        return saved
