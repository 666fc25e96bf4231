"""The engine's requests about saved sessions: prefetch, restore from a file, checkpoint, release, persist.

Owns when a saved copy is current (its session version and transcript
mark), which idle sessions are worth a checkpoint, opening a session from its
file (read off the step loop, landed between steps, answered then), and
moving an idle session out of memory. Every memory decision goes through the
scheduler's placer; the pager only copies.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.session import EngineSession, Residency
from streamchat.tiers.kvfile import KVFileError


class Later:
    """A command's result that comes after its handler returned (a file being read).

    The core sets `on_done`; `resolve` runs on the engine's thread.
    """

    def __init__(self) -> None:
        self.done = False
        self.value = None
        self.on_done: Callable[[Later], None] | None = None

    def resolve(self, value) -> None:
        self.done, self.value = True, value
        if self.on_done is not None:
            self.on_done(self)


class Saver:
    def __init__(self, engine) -> None:
        self.eng = engine
        self.placer = engine.scheduler.placer

    def prefetch(self, s: EngineSession) -> str:
        """A client attached: bring its KV up before its first item; the tier it came from.

        From the host it lands now; a file is read on the reader thread (work queued meanwhile
        waits for it); a session dropped to its tokens starts its rebuild.
        """
        origin = s.residency
        if not s.busy:
            self.placer.prefetch(s)
        return origin.value

    def restore_saved(self, c: api.RestoreSaved):
        """Open a session from its file: None once restored, else why not (nothing is opened).

        Returns a `Later` when the file is read off the loop."""
        eng = self.eng
        if c.session_id in eng.sessions:
            raise EngineError("invalid_event", f"session {c.session_id} is already open")
        later = Later()
        self.placer.read(c.session_id, c.mark, lambda result: later.resolve(self._restored(c, result)))
        return later.value if later.done else later

    def _restored(self, c: api.RestoreSaved, snap) -> str | None:
        eng, pager = self.eng, self.placer.pager
        if isinstance(snap, KVFileError):
            return snap.reason
        if c.session_id in eng.sessions:  # opened by another way while its file was read
            return "inconsistent"
        prefix = list(c.prefix)
        pinned = len(prefix) if eng.cache_cfg.pin_system_prompt else 0
        st = snap.state
        # An unpinned system prompt may have been evicted past the sink blocks: compare what must remain.
        sink = st.num_sink_blocks * eng.cache_cfg.block_size
        kept = len(prefix) if pinned or not st.evicted_tokens else min(len(prefix), sink)  # an empty prompt: 0
        if st.token_ids[:kept] != prefix[:kept] or st.pinned_tokens != pinned:
            pager.note_failure("prompt")
            return "prompt"
        s = eng.open(c.session_id, [])
        s.pinned_tokens = pinned
        s.seq = eng.manager.new_seq(pinned)
        if not self.placer.land_file(s, snap):
            del eng.sessions[c.session_id]
            pager.note_failure("no_room")
            return "no_room"
        s.total_tokens, s.transcript_mark = snap.state.total_tokens, snap.mark
        s.open_item, s.num_items = c.open_item, c.num_items
        pager.adopt(c.session_id, s.kv_version)
        return None

    def candidates(self, idle_s: float) -> list[str]:
        """Sessions idle for `idle_s` whose current state is not on disk with a transcript mark."""
        if not self.placer.has_disk:
            return []
        now = self.eng.clock()
        return [s.session_id for s in self.eng.sessions.values()
                if not s.busy and now - s.last_active >= idle_s and s.residency is not Residency.DROPPED
                and not (self.placer.on_disk(s) and s.transcript_mark is not None)]

    def checkpoint(self, session_id: str, mark: str) -> bool:
        """Save an idle session's current state to disk, stamped with the transcript it matches."""
        s = self.eng.sessions.get(session_id)
        pager = self.placer.pager
        if s is None or not self.placer.has_disk or s.busy:
            return False
        s.transcript_mark = mark
        if pager.on_disk(session_id, s.kv_version):
            return pager.disk_mark(session_id) == mark or pager.restamp(session_id, mark)
        if s.resident and s.seq.block_ids:
            from streamchat.tiers.pager import state_of

            state = state_of(s.seq, s.pinned_tokens, s.total_tokens)
            return pager.save_device(session_id, state, s.seq.block_ids, s.kv_version, mark)
        if s.residency is Residency.HOST:
            return pager.save_host(session_id, s.kv_version, mark)
        return False

    def release(self, session_id: str, mark: str | None) -> bool:
        """An idle session nobody holds leaves memory: saved to disk when it can be, then closed.

        With no file (no disk tier, or the save failed) a later resume rebuilds it
        from its transcript, which is the store's to keep.
        """
        s = self.eng.sessions.get(session_id)
        if s is None:
            return True
        if s.busy:
            return False
        saved = mark is not None and self.checkpoint(session_id, mark)
        self.eng.close_session(session_id, keep_saved=saved)
        return True

    def persist(self, marks: dict[str, str], timeout_s: float = 10.0) -> int:
        """Shutdown: finish queued prefill (until the deadline), then save the listed sessions."""
        if not self.placer.has_disk:
            return 0
        eng = self.eng
        deadline = time.monotonic() + timeout_s
        while (eng.has_work() or self.placer.reading) and time.monotonic() < deadline:
            if eng.has_work():
                eng.command_events += eng.step()
            else:
                time.sleep(0.01)
                self.placer.take_loads()
        saved = sum(1 for sid, mark in marks.items()
                    if time.monotonic() < deadline and self.checkpoint(sid, mark))
        self.placer.pager.flush()
        return saved
