"""The engine: sessions as long-lived token sequences over one model, stepped synchronously.

Owns the sessions' engine-side state and the commands that change it
(`handle(cmd)` takes the typed commands of `engine.api`, all in token ids:
the front frames and tokenizes). `step()` is schedule -> run -> postprocess
(`engine.step`), synchronous and deterministic under a seed; it does no I/O.
Exactly one thread may call into an Engine (the core process's main thread
in the daemon; the caller in tests and the LLM class). Where a session's KV
lives is its scheduler's placer's alone; saving to disk is `engine.saving`.
Its text methods (`engine.text_calls`: `open_session`, `add_item`, ...)
frame and tokenize with the model's own tokenizer, for in-process callers.
"""

from __future__ import annotations

import logging
import time

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import H2O, KVCacheManager
from streamchat.config import CacheConfig, ConfigError, SchedulerConfig, TierConfig
from streamchat.engine import api
from streamchat.engine.admission import Admission
from streamchat.engine.api import EngineError
from streamchat.engine.events import EngineEvent
from streamchat.engine.metrics import EngineMetrics
from streamchat.engine.saving import Saver
from streamchat.engine.scheduler import Scheduler
from streamchat.engine.session import EngineSession, Pending, Response
from streamchat.engine.step import Stepper
from streamchat.engine.text_calls import TextCalls
from streamchat.model.sampling import make_generator
from streamchat.text.chat import ChatFormat
from streamchat.tiers import build_pager

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineError"]


class Engine(TextCalls, Admission):
    def __init__(self, runner, cache: CacheConfig, scheduler: SchedulerConfig,
                 metrics: EngineMetrics | None = None, clock=time.monotonic,
                 tiers: TierConfig | None = None, data_dir=None, sync_io: bool = True) -> None:
        self.runner = runner
        self.tokenizer = runner.loaded.tokenizer
        self.chat = getattr(self.tokenizer, "chat", None) or ChatFormat.of(self.tokenizer)  # a card's has one
        self.cache_cfg = cache
        self.pool = BlockPool(runner.num_blocks)
        extra = (f"{runner.loaded.source.fingerprint}:{runner.model.dtype}:{runner.kv_dtype}:"
                 f"{cache.block_size}").encode()
        self.manager = KVCacheManager(self.pool, cache.block_size, cache.sink_tokens,
                                      cache.window_tokens, extra, cache.prefix_sharing, cache.eviction,
                                      H2O(cache.h2o_recent_tokens, cache.h2o_decay))
        if cache.eviction == "h2o" and not getattr(runner.model.backend, "computes_mass", False):
            raise ConfigError(f"--eviction h2o needs attention mass per block, which the cpu and torch attention "
                              f"backends compute (not {runner.model.backend.name!r}); use --attention-backend "
                              f"cpu or torch, or --eviction sink_window")
        if cache.max_blocks_per_session() > self.pool.num_usable:
            raise ConfigError(
                f"sink_tokens + window_tokens need {cache.max_blocks_per_session()} blocks per session, "
                f"but the KV pool has only {self.pool.num_usable}; lower window_tokens or enlarge the pool")
        self.sessions: dict[str, EngineSession] = {}
        # host and disk tiers below the pool (None: idle sessions are dropped to their tokens)
        pager = build_pager(tiers, runner, cache, self.manager, data_dir) if tiers else None
        self.scheduler = Scheduler(scheduler, self.manager, pager, self.sessions, sync_io)
        self.placer = self.scheduler.placer
        self.sched_cfg = scheduler
        self.metrics = metrics or EngineMetrics()
        self.clock = clock
        self.eos_ids = _eos_ids(runner.loaded.hf_config, self.tokenizer)
        self.failed_steps = 0  # in a row; reset by a step that succeeds
        self.stepper = Stepper(self)
        self.saver = Saver(self)
        self.command_events: list[EngineEvent] = []  # events commands made (cancel, close, stop)
        self._handlers = {
            api.OpenSession: lambda c: self._none(self.open(c.session_id, list(c.prefix))),
            api.RestoreTranscript: self.restore_transcript,
            api.RestoreSaved: self.saver.restore_saved,
            api.SetInstructions: lambda c: self.set_prefix(c.session_id, list(c.prefix)),
            api.CheckRoom: lambda c: self.check_room(self._get(c.session_id), c.num_tokens),
            api.Queue: self.queue,
            api.StartResponse: self.start,
            api.CancelResponse: lambda c: self._report(self.cancel_response(c.session_id)),
            api.StopResponse: lambda c: self._report(self.stop_response(c.session_id, c.response_id,
                                                                        c.num_tokens)),
            api.CloseSession: lambda c: self._report(self.close_session(c.session_id, c.keep_saved)),
            api.Prefetch: lambda c: self.saver.prefetch(self._get(c.session_id)),
            api.GetStats: lambda c: self.session_stats(c.session_id),
            api.CheckpointCandidates: lambda c: self.saver.candidates(c.idle_s),
            api.Checkpoint: lambda c: self.saver.checkpoint(c.session_id, c.mark),
            api.Release: lambda c: self.saver.release(c.session_id, c.mark),
            api.Persist: lambda c: self.saver.persist(c.marks, c.timeout_s),
        }

    @property
    def pager(self):
        return self.scheduler.pager

    def handle(self, cmd: api.Command):
        """Run one typed command; its result (events it made go to `command_events`)."""
        return self._handlers[type(cmd)](cmd)

    def _report(self, events: list[EngineEvent]) -> None:
        self.command_events += events

    @staticmethod
    def _none(_) -> None:
        return None

    # -- sessions -----------------------------------------------------------------------

    def open(self, session_id: str, prefix: list[int]) -> EngineSession:
        """A new session whose context starts with `prefix` (pinned as the system prompt)."""
        if session_id in self.sessions:
            raise EngineError("invalid_event", f"session {session_id} is already open")
        self.check_instructions(len(prefix), pinned=True)
        pinned = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        s = EngineSession(session_id, self.manager.new_seq(pinned), pinned, last_active=self.clock())
        self.sessions[session_id] = s
        if prefix:
            s.pending.append(Pending(prefix))
            self.scheduler.activate(s)
        return s

    def restore_transcript(self, c: api.RestoreTranscript) -> int:
        """Open a session from its transcript tokens: the prefix plus the most recent tokens that
        fit the window (the prefix cache serves every full block it shares with earlier ones).
        Returns the transcript's length. `admit`: new work, refused `overloaded` past the limit."""
        tokens = c.tokens
        keep = tokens[max(0, len(tokens) - (self.manager.window_cap - self.cache_cfg.block_size)):]
        self.check_instructions(len(c.prefix), pinned=True)
        if c.admit:
            self._check_load(len(keep) + len(c.prefix))
        s = self.open(c.session_id, list(c.prefix))
        self.placer.changed(s)  # no saved copy of an earlier life of this session is current
        s.open_item, s.num_items = c.open_item, c.num_items
        if keep:
            s.pending.append(Pending(list(keep)))
            self.scheduler.activate(s)
        return len(tokens)

    def set_prefix(self, session_id: str, prefix: list[int]) -> None:
        """Replace the pinned system prompt; the rest of the context is kept and rebuilt.

        Queued work keeps its tickets: every item still prefilling is reported when in.
        """
        s = self._get(session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response", "a response is running")
        self.check_instructions(len(prefix), pinned=True)
        self._check_load(len(prefix))  # the whole context is rebuilt behind it: the prompt is new work
        self.placer.changed(s)
        self.placer.reset(s, len(prefix) if self.cache_cfg.pin_system_prompt else 0, prefix)

    def context_tokens(self, session_id: str) -> int:
        """Tokens the session will attend to once its queued work is in (sinks plus window)."""
        s = self._get(session_id)
        sink = s.seq.num_sink_blocks * self.cache_cfg.block_size
        total = len(s.seq.token_ids if s.resident else s.dropped_tokens) + s.queued_tokens
        return min(total, sink + self.manager.window_cap)

    def queue(self, c: api.Queue) -> int:
        """Queue tokens the store holds now; returns the context after them."""
        s = self._get(c.session_id)
        if c.kind == "item":
            if c.closes_item != s.open_item:
                raise EngineError("invalid_event", "the open item changed since this item was prepared")
            s.open_item = False
            s.num_items += 1
        elif c.kind == "append":
            if c.opens_item == s.open_item:
                raise EngineError("invalid_event", "the open item changed since this append was prepared")
            s.num_items += c.opens_item
            s.open_item = True
        elif c.kind == "commit":
            if not s.open_item:
                raise EngineError("invalid_event", "no open item to commit")
            s.open_item = False
        else:
            raise EngineError("invalid_event", f"unknown kind of queued work {c.kind!r}")
        self._queue(s, Pending(list(c.token_ids), c.ticket))
        return self.context_tokens(s.session_id)

    def _queue(self, s: EngineSession, work: Pending) -> None:
        self.placer.wake(s)
        self.scheduler.activate(s)
        if s.response is not None:
            s.deferred.append(work)  # joins the context after the running response
        else:
            s.pending.append(work)

    # -- responses ----------------------------------------------------------------------

    def start(self, c: api.StartResponse) -> None:
        """Queue a reply. `instructions` are a system message for this turn only: once the
        response ends they leave the context (the reply is recomputed without them)."""
        s = self._get(c.session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response",
                              "a response is already running in this session")
        if c.instructions:  # refused before anything changes
            self.check_instructions(len(c.instructions), pinned=False)
            self.check_room(s, len(c.instructions) + len(c.close))
        if c.close:
            if not s.open_item:
                raise EngineError("invalid_event", "no open item to close")
            s.open_item = False
            self._queue(s, Pending(list(c.close)))
        elif s.open_item:
            raise EngineError("invalid_event", "the open item must be closed before a response")
        self.placer.wake(s)
        r = Response(c.response_id, c.params, c.max_tokens, make_generator(c.params), created_at=self.clock())
        r.instructions = list(c.instructions)
        s.pending.append(Pending(r.instructions + self.chat.reply_prompt(), starts_response=True))
        s.num_items += 1  # the reply is an item of the conversation too
        s.response = r
        self.scheduler.activate(s)

    def cancel_response(self, session_id: str) -> list[EngineEvent]:
        """Stop the running response; [] if none runs."""
        s = self._get(session_id)
        return self.stepper.finish(s, "cancelled", "client_cancelled") if s.response else []

    def stop_response(self, session_id: str, response_id: str, num_tokens: int) -> list[EngineEvent]:
        return self.stepper.stop(self._get(session_id), response_id, num_tokens)

    def close_session(self, session_id: str, keep_saved: bool = False) -> list[EngineEvent]:
        """End the session here: stop its response, free its blocks (and its saved file unless
        `keep_saved`: then it can come back from it)."""
        s = self.sessions.get(session_id)
        if s is None:
            return []
        events = self.stepper.finish(s, "incomplete", "client_disconnected") if s.response else []
        self.placer.forget(s, delete_file=not keep_saved)
        del self.sessions[session_id]
        self.scheduler.active.pop(session_id, None)
        return events

    def session_stats(self, session_id: str) -> api.SessionStats:
        s = self._get(session_id, touch=False)  # reading a session's figures is not using it
        st = self.manager.stats(s.seq)
        if s.parked is not None:  # in a lower tier: its cache as it will come back
            st = st._replace(context_tokens=len(s.parked.token_ids), evicted_tokens=s.parked.evicted_tokens)
        return api.SessionStats(
            context_tokens=st.context_tokens, total_tokens=s.total_tokens, evicted_tokens=st.evicted_tokens,
            cached_tokens=st.cached_tokens, owned_blocks=st.owned_blocks, shared_blocks=st.shared_blocks,
            pool_cached_free=self.pool.num_cached_free, pool_free=self.pool.num_free,
            prefix_queried_tokens=s.seq.queried_tokens, prefix_hit_tokens=s.seq.cached_tokens,
            kv_bytes=len(s.seq.block_ids) * self.runner.bytes_per_block, items=s.num_items,
            queued_tokens=s.queued_tokens, residency=s.residency.value, on_disk=self.placer.on_disk(s),
            eviction=s.seq.eviction)

    def _get(self, session_id: str, touch: bool = True) -> EngineSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise EngineError("session_not_found", f"no session {session_id}")
        if touch:
            s.last_active = self.clock()
        return s

    # -- the step -----------------------------------------------------------------------

    def has_work(self) -> bool:
        """A step would do something (sessions whose file is still being read wait for it)."""
        return any(s.runnable for s in self.scheduler.active.values())

    def step(self) -> list[EngineEvent]:
        self.placer.take_loads()
        events, self.command_events = self.command_events, []
        events += self.stepper.step()
        self.scheduler.prune()
        return events

    def check(self) -> None:
        """Assert the pool and every session's table agree, the tiers hold what they say, and every
        session with work is among the active ones."""
        self.manager.check([s.seq for s in self.sessions.values()])
        self.placer.check()
        busy = {sid for sid, s in self.sessions.items() if s.busy}
        assert busy <= set(self.scheduler.active), busy - set(self.scheduler.active)


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
