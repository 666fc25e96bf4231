"""The engine: sessions as long-lived sequences over one model, stepped synchronously.

Owns the sessions' engine-side state and turns each step's logits into
tokens, text deltas and finished responses. `step()` is synchronous and
deterministic under a seed; it does no I/O. Exactly one thread may call into
an Engine (the AsyncEngine's thread in the daemon; the caller in tests).
"""

from __future__ import annotations

import logging
import time

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, ConfigError, SchedulerConfig, TierConfig
from streamchat.engine.events import EngineEvent, ItemPrefilled, ResponseFinished, TextDelta
from streamchat.engine.metrics import EngineMetrics
from streamchat.engine.scheduler import Scheduler
from streamchat.engine.session import EngineSession, Pending, Phase, Response
from streamchat.model.sampling import SamplingParams, make_generator, sample
from streamchat.text.chat import ChatFormat
from streamchat.text.detok import IncrementalDetokenizer
from streamchat.tiers import Snapshot, build_pager, kvfile

log = logging.getLogger(__name__)


class EngineError(Exception):
    """A request the engine cannot take; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Engine:
    def __init__(self, runner, cache: CacheConfig, scheduler: SchedulerConfig,
                 metrics: EngineMetrics | None = None, clock=time.monotonic,
                 tiers: TierConfig | None = None, data_dir=None) -> None:
        self.runner = runner
        self.tokenizer = runner.loaded.tokenizer
        self.chat = ChatFormat(self.tokenizer)
        self.cache_cfg = cache
        self.pool = BlockPool(runner.num_blocks)
        extra = (f"{runner.loaded.source.fingerprint}:{runner.model.dtype}:{runner.kv_dtype}:"
                 f"{cache.block_size}").encode()
        self.manager = KVCacheManager(self.pool, cache.block_size, cache.sink_tokens,
                                      cache.window_tokens, extra, cache.prefix_sharing)
        if cache.max_blocks_per_session() > self.pool.num_usable:
            raise ConfigError(
                f"sink_tokens + window_tokens need {cache.max_blocks_per_session()} blocks per session, "
                f"but the KV pool has only {self.pool.num_usable}; lower window_tokens or enlarge the pool")
        self.scheduler = Scheduler(scheduler, self.manager)
        # host and disk tiers below the pool (None: idle sessions are dropped to their tokens)
        self.pager = build_pager(tiers, runner, cache, self.manager, data_dir) if tiers else None
        self.scheduler.pager = self.pager
        self.sched_cfg = scheduler
        self.sessions: dict[str, EngineSession] = {}
        self.metrics = metrics or EngineMetrics()
        self.clock = clock
        self.eos_ids = _eos_ids(runner.loaded.hf_config, self.tokenizer)

    # -- requests (engine thread only) --------------------------------------

    def open_session(self, session_id: str, instructions: str = "") -> None:
        if session_id in self.sessions:
            raise EngineError("invalid_event", f"session {session_id} is already open")
        prefix = self._system_tokens(instructions)
        pinned = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        s = EngineSession(session_id, self.manager.new_seq(pinned), pinned, last_active=self.clock())
        if prefix:
            s.pending.append(Pending(prefix))
        self.sessions[session_id] = s

    def restore_session(self, session_id: str, instructions: str,
                        messages: list[tuple[str, str, bool]]) -> int:
        """Open a session from its transcript: (role, text, closed) per item, oldest first.

        The context becomes the system prompt plus the most recent tokens that
        fit the window (the prefix cache serves the system prompt). Returns
        the transcript's length in tokens.
        """
        self.open_session(session_id, instructions)
        s = self.sessions[session_id]
        self._changed(s)  # no saved copy of an earlier life of this session is current
        tokens: list[int] = []
        for role, text, closed in messages:
            tokens += self.chat.message(role, text) if closed else self.chat.open_message(role) + self.chat.encode(text)
        s.open_item = bool(messages) and not messages[-1][2]
        s.num_items = len(messages)
        keep = self.manager.window_cap - self.cache_cfg.block_size
        if tokens:
            s.pending.append(Pending(tokens[-keep:]))
        return len(tokens)

    def context_tokens(self, session_id: str) -> int:
        """Tokens the session will attend to once its queued work is in (sinks plus window)."""
        s = self._get(session_id)
        queued = sum(p.remaining for p in s.pending) + sum(p.remaining for p in s.deferred)
        sink = s.seq.num_sink_blocks * self.cache_cfg.block_size
        total = s.seq.num_tokens + queued
        return total if total <= sink + self.manager.window_cap else sink + self.manager.window_cap

    def _system_tokens(self, instructions: str) -> list[int]:
        body = self.chat.message("system", instructions) if instructions else []
        return self.chat.bos_ids + body

    def set_instructions(self, session_id: str, instructions: str) -> None:
        """Replace the pinned system prompt; the rest of the context is kept and rebuilt."""
        s = self._get(session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response", "a response is running")
        tail = self._context_tokens(s)[s.pinned_tokens:]
        self._changed(s)
        if self.pager is not None:
            self.pager.discard(s)  # every position's KV changes with the prompt: nothing to page in
        self.scheduler.manager.free(s.seq)
        prefix = self._system_tokens(instructions)
        s.pinned_tokens = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        s.seq = self.manager.new_seq(s.pinned_tokens)
        s.resident, s.dropped_tokens, s.tier = True, [], "device"
        queued = [t for p in s.pending for t in p.token_ids[p.done:]]
        s.pending.clear()
        s.pending.append(Pending(prefix + tail + queued))

    def _context_tokens(self, s: EngineSession) -> list[int]:
        return list(s.seq.token_ids) if s.resident else list(s.dropped_tokens)

    def add_item(self, session_id: str, role: str, text: str, ticket=None) -> int:
        """Frame and queue a whole message; returns its token count."""
        s = self._get(session_id)
        tokens = self._close_open(s) + self.chat.message(role, text)
        self._queue(s, Pending(tokens, ticket))
        s.num_items += 1
        return len(tokens)

    def append_text(self, session_id: str, text: str, ticket=None) -> int:
        """Raw text into the open user item (opened on the first append); returns tokens added."""
        s = self._get(session_id)
        tokens = [] if s.open_item else self.chat.open_message("user")
        if not s.open_item:
            s.num_items += 1
        s.open_item = True
        tokens += self.chat.encode(text)
        self._queue(s, Pending(tokens, ticket))
        return len(tokens)

    def commit_text(self, session_id: str, ticket=None) -> bool:
        """Close the open item; False if none was open."""
        s = self._get(session_id)
        tokens = self._close_open(s)
        if tokens:
            self._queue(s, Pending(tokens, ticket))
        return bool(tokens)

    def _close_open(self, s: EngineSession) -> list[int]:
        if not s.open_item:
            return []
        s.open_item = False
        return self.chat.close_message("user")

    def start_response(self, session_id: str, response_id: str, params: SamplingParams,
                       max_tokens: int | None = None, stop: tuple[str, ...] = (),
                       instructions: str | None = None) -> None:
        s = self._get(session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response",
                              "a response is already running in this session")
        tokens = self._close_open(s)
        if instructions:
            tokens += self.chat.message("system", instructions)
        self._wake(s)
        s.pending.append(Pending(tokens + self.chat.reply_prompt(), starts_response=True))
        s.num_items += 1  # the reply is an item of the conversation too
        s.response = Response(response_id, params, max_tokens,
                              IncrementalDetokenizer(self.tokenizer, stop), make_generator(params),
                              created_at=self.clock())

    def cancel_response(self, session_id: str) -> list[EngineEvent]:
        """Stop the running response; [] if none runs."""
        s = self._get(session_id)
        if s.response is None:
            return []
        return self._finish(s, "cancelled", "client_cancelled")

    def close_session(self, session_id: str, keep_saved: bool = False) -> list[EngineEvent]:
        """End the session here: stop its response, free its blocks (and its saved file unless
        `keep_saved`: then it can come back with `restore_saved`)."""
        s = self.sessions.get(session_id)
        if s is None:
            return []
        events = self._finish(s, "incomplete", "client_disconnected") if s.response else []
        if self.pager is not None:
            self.pager.discard(s, delete_file=not keep_saved)
        self.manager.free(s.seq)
        del self.sessions[session_id]
        return events

    def session_stats(self, session_id: str) -> dict:
        s = self._get(session_id)
        st = self.manager.stats(s.seq)
        if s.parked is not None:  # in a lower tier: its cache as it will come back
            st = st._replace(context_tokens=len(s.parked.token_ids), evicted_tokens=s.parked.evicted_tokens)
        return {
            "context_tokens": st.context_tokens, "total_tokens": s.total_tokens,
            "evicted_tokens": st.evicted_tokens, "cached_tokens": st.cached_tokens,
            "blocks": {"owned": st.owned_blocks, "shared": st.shared_blocks,
                       "pool_cached_free": self.pool.num_cached_free, "pool_free": self.pool.num_free},
            "prefix": {"queried_tokens": s.seq.queried_tokens, "hit_tokens": s.seq.cached_tokens},
            "kv_bytes": len(s.seq.block_ids) * self.runner.bytes_per_block,
            "items": s.num_items, "resident": s.resident, "tier": s.tier,
            "on_disk": self.pager is not None and self.pager.on_disk(s),
        }

    def _get(self, session_id: str) -> EngineSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise EngineError("session_not_found", f"no session {session_id}")
        s.last_active = self.clock()
        return s

    def _queue(self, s: EngineSession, work: Pending) -> None:
        self._wake(s)
        if s.response is not None:
            s.deferred.append(work)  # joins the context after the running response
        else:
            s.pending.append(work)

    def _wake(self, s: EngineSession) -> None:
        """Its context is about to change: bring its KV back up, or rebuild it from its tokens."""
        self._changed(s)
        if s.resident or (self.pager is not None and self.pager.page_in(s, self._room_for(s))):
            return
        if self.pager is not None:
            self.pager.discard(s)
        s.pending.appendleft(Pending(s.dropped_tokens))
        s.resident, s.dropped_tokens, s.tier = True, [], "device"

    @staticmethod
    def _changed(s: EngineSession) -> None:
        s.kv_version += 1  # saved copies of the old context are no longer current
        s.transcript_mark = None

    def _room_for(self, s: EngineSession):
        """make_free(n) for a page-in: idle sessions page down until n device blocks are free."""
        return lambda n: self.scheduler.make_free(n, list(self.sessions.values()), s)

    # -- tiers (engine thread only) -------------------------------------------------

    def prefetch(self, session_id: str) -> str:
        """A client attached: bring its KV up before its first item; the tier it came from.

        A session dropped to its tokens starts its rebuild now, in the background.
        """
        s = self._get(session_id)
        origin = s.tier
        if origin in ("host", "disk") and not s.busy and self.pager.page_in(s, self._room_for(s)):
            return origin
        if s.tier == "dropped":  # never had a lower-tier copy, or its file was refused
            self._wake(s)
            return "dropped"
        return s.tier

    def restore_saved(self, session_id: str, instructions: str, messages: list[tuple[str, str, bool]],
                      snap: Snapshot) -> str | None:
        """Open a session from its saved KV; None on success, else why not (then it is not opened).

        `messages` are its transcript items as for `restore_session`, which
        give the chat state (open item, item count); the KV comes from `snap`.
        """
        if session_id in self.sessions:
            raise EngineError("invalid_event", f"session {session_id} is already open")
        state = snap.state
        prefix = self._system_tokens(instructions)
        pinned = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        if state.token_ids[:len(prefix)] != prefix or state.pinned_tokens != pinned:
            return "prompt"
        s = EngineSession(session_id, self.manager.new_seq(pinned), pinned, last_active=self.clock())
        kv = self.runner.kv_caches
        seq = self.pager.to_device(state, lambda rows, ids: kvfile.scatter(snap.tensors, rows, kv, ids),
                                   self._room_for(s))
        if seq is None:
            return "no_room"
        s.seq, s.total_tokens, s.transcript_mark = seq, state.total_tokens, snap.mark
        s.open_item = bool(messages) and not messages[-1][2]
        s.num_items = len(messages)
        self.sessions[session_id] = s
        self.pager.disk.adopt(session_id, s.kv_version)
        self.pager.moves[("disk", "device")] += 1
        return None

    def checkpoint_candidates(self, idle_s: float) -> list[str]:
        """Sessions idle for `idle_s` whose current state is not on disk with a transcript mark."""
        if self.pager is None or self.pager.disk is None:
            return []
        now = self.clock()
        return [s.session_id for s in self.sessions.values()
                if not s.busy and now - s.last_active >= idle_s and s.tier != "dropped"
                and not (self.pager.on_disk(s) and s.transcript_mark is not None)]

    def checkpoint(self, session_id: str, mark: str) -> bool:
        """Save an idle session to disk, stamped with the transcript it matches."""
        s = self.sessions.get(session_id)
        return s is not None and self.pager is not None and self.pager.checkpoint(s, mark)

    def persist(self, marks: dict[str, str], timeout_s: float = 10.0) -> int:
        """Shutdown: finish queued prefill, then save the listed sessions to disk; returns how many."""
        if self.pager is None or self.pager.disk is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while self.has_work() and time.monotonic() < deadline:
            self.step()
        saved = sum(1 for sid, mark in marks.items() if self.checkpoint(sid, mark))
        self.pager.flush()
        return saved

    # -- the step -------------------------------------------------------------

    def has_work(self) -> bool:
        return any(s.pending or s.response for s in self.sessions.values())

    def step(self) -> list[EngineEvent]:
        """Schedule, run the model once, sample, and report what happened."""
        events = self._expire()
        sessions = list(self.sessions.values())
        sched = self.scheduler.schedule(sessions)
        if not sched.batch:  # work served entirely from the prefix cache still completes
            return events + [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
        started = time.perf_counter()
        logits = self.runner.execute(sched.batch)
        events += [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
        samplers = [o for o, c in zip(sched.owners, sched.batch.chunks()) if c.want_logits]
        if samplers:
            tokens = sample(logits, [o.response.params for o in samplers],
                            [o.response.generator for o in samplers])
            for s, token in zip(samplers, tokens):
                events += self._on_token(s, token)
        self.metrics.on_step(sched.batch.num_tokens, len(sched.batch.decode),
                             time.perf_counter() - started)
        return events

    def _expire(self) -> list[EngineEvent]:
        now, limit = self.clock(), self.sched_cfg.queue_timeout_s
        events: list[EngineEvent] = []
        for s in list(self.sessions.values()):
            r = s.response
            if r and r.first_token_at is None and now - r.created_at > limit:
                events += self._finish(s, "failed", "overloaded")
        return events

    def _on_token(self, s: EngineSession, token: int) -> list[EngineEvent]:
        r = s.response
        now = self.clock()
        if r.phase is not Phase.DECODE:
            r.phase, r.first_token_at = Phase.DECODE, now
            r.input_tokens = s.seq.num_tokens
            r.cached_tokens = max(0, r.input_tokens - s.computed_this_turn)
            self.metrics.on_first_token(now - r.created_at)
        else:
            self.metrics.on_token_gap(now - r.last_token_at)
        r.last_token_at = now
        if token in self.eos_ids:
            return self._finish(s, "completed", None)
        r.output_ids.append(token)
        delta = r.detok.add(token)
        events: list[EngineEvent] = [TextDelta(s.session_id, r.response_id, delta)] if delta else []
        r.next_token = token
        if r.detok.stopped:
            return events + self._finish(s, "completed", None)
        if r.max_tokens is not None and len(r.output_ids) >= r.max_tokens:
            return events + self._finish(s, "incomplete", "max_output_tokens")
        return events

    def _finish(self, s: EngineSession, status: str, reason: str | None) -> list[EngineEvent]:
        r = s.response
        rest = r.detok.flush()
        events: list[EngineEvent] = [TextDelta(s.session_id, r.response_id, rest)] if rest else []
        tail = [r.next_token] if r.next_token is not None else []
        s.response = None
        for p in s.pending:  # a reply cut before its first token: its prompt stays plain context
            p.starts_response = False
        s.pending.append(Pending(tail + self.chat.reply_end()))
        s.pending.extend(s.deferred)
        s.deferred.clear()
        s.computed_this_turn = 0
        events.append(ResponseFinished(s.session_id, r.response_id, status, reason, r.detok.text,
                                       self._usage(s, r), tuple(r.output_ids)))
        return events

    def _usage(self, s: EngineSession, r: Response) -> dict:
        now = self.clock()
        out = len(r.output_ids)
        gen_s = (now - r.first_token_at) if r.first_token_at else 0.0
        return {
            "input_tokens": r.input_tokens, "output_tokens": out,
            "total_tokens": r.input_tokens + out,
            "input_token_details": {"cached_tokens": r.cached_tokens, "text_tokens": r.input_tokens},
            "output_token_details": {"text_tokens": out},
            "context_tokens": s.seq.num_tokens, "evicted_tokens": s.seq.evicted_tokens,
            "timing": {
                "ttft_ms": round((r.first_token_at - r.created_at) * 1000, 2) if r.first_token_at else None,
                "output_tokens_per_s": round((out - 1) / gen_s, 2) if out > 1 and gen_s > 0 else None,
            },
        }

    def check(self) -> None:
        """Assert the pool and every session's table agree, and the tiers hold what they say."""
        self.manager.check([s.seq for s in self.sessions.values()])
        if self.pager is not None:
            self.pager.check(self.sessions.values())


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
