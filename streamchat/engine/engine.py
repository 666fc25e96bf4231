"""The engine: sessions as long-lived sequences over one model, stepped synchronously.

Owns the sessions' engine-side state and turns each step's logits into
tokens, text deltas and finished responses. `handle(cmd)` takes the typed
commands of `engine.api`; the methods behind it are the in-process API (the
LLM class, tests). `step()` is schedule -> run -> postprocess, synchronous
and deterministic under a seed; it does no I/O. Exactly one thread may call
into an Engine (the AsyncEngine's thread in the daemon; the caller in tests).

A step that raises never leaves the engine broken: the responses it carried
fail (`internal`) and their sessions are rebuilt from their tokens; the
next step serves on. Tiers (host, disk) are reached through the scheduler,
which owns the pager; `engine.tiering` holds the requests about them.
"""

from __future__ import annotations

import logging
import time

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import H2O, KVCacheManager
from streamchat.config import CacheConfig, ConfigError, SchedulerConfig, TierConfig
from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.events import EngineEvent, ItemPrefilled, ResponseFinished, TextDelta
from streamchat.engine.metrics import EngineMetrics
from streamchat.engine.scheduler import Scheduler
from streamchat.engine.session import EngineSession, Pending, Phase, Response
from streamchat.engine.tiering import Tiering
from streamchat.model.sampling import REPETITION_WINDOW, SamplingParams, TokenHistory, make_generator, sample
from streamchat.text.chat import ChatFormat
from streamchat.text.detok import IncrementalDetokenizer
from streamchat.tiers import build_pager

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineError"]


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
        # host and disk tiers below the pool (None: idle sessions are dropped to their tokens)
        pager = build_pager(tiers, runner, cache, self.manager, data_dir) if tiers else None
        self.scheduler = Scheduler(scheduler, self.manager, pager)
        self.sched_cfg = scheduler
        self.sessions: dict[str, EngineSession] = {}
        self.metrics = metrics or EngineMetrics()
        self.clock = clock
        self.eos_ids = _eos_ids(runner.loaded.hf_config, self.tokenizer)
        self.tiering = Tiering(self)
        self.failed_steps = 0  # in a row; reset by a step that succeeds
        self._handlers = {
            api.OpenSession: lambda c: self.open_session(c.session_id, c.instructions),
            api.RestoreTranscript: lambda c: self.restore_session(c.session_id, c.instructions, list(c.messages),
                                                                  c.admit),
            api.RestoreSaved: lambda c: self.tiering.restore_saved(c.session_id, c.instructions,
                                                                   list(c.messages), c.snapshot),
            api.SetInstructions: lambda c: self.set_instructions(c.session_id, c.instructions),
            api.PrepareItem: lambda c: self.prepare_item(c.session_id, c.role, c.text),
            api.PrepareAppend: lambda c: self.prepare_append(c.session_id, c.text),
            api.Queue: lambda c: self.queue(c.prepared, c.ticket),
            api.CommitText: lambda c: self.commit_text(c.session_id, c.ticket),
            api.StartResponse: lambda c: self.start_response(c.session_id, c.response_id, c.params,
                                                             c.max_tokens, c.stop, c.instructions),
            api.CancelResponse: lambda c: self.cancel_response(c.session_id),
            api.CloseSession: lambda c: self.close_session(c.session_id, c.keep_saved),
            api.Prefetch: lambda c: self.tiering.prefetch(c.session_id),
            api.GetStats: lambda c: self.session_stats(c.session_id),
            api.CheckpointCandidates: lambda c: self.tiering.checkpoint_candidates(c.idle_s),
            api.Checkpoint: lambda c: self.tiering.checkpoint(c.session_id, c.mark),
            api.Release: lambda c: self.tiering.release(c.session_id, c.mark),
            api.Persist: lambda c: self.tiering.persist(c.marks, c.timeout_s),
        }

    @property
    def pager(self):
        return self.scheduler.pager

    def handle(self, cmd: api.Command):
        """Run one typed command; its result (events for commands that end responses)."""
        return self._handlers[type(cmd)](cmd)

    # -- sessions ---------------------------------------------------------------------

    def open_session(self, session_id: str, instructions: str = "") -> None:
        if session_id in self.sessions:
            raise EngineError("invalid_event", f"session {session_id} is already open")
        prefix = self._system_tokens(instructions)
        pinned = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        s = EngineSession(session_id, self.manager.new_seq(pinned), pinned, last_active=self.clock())
        if prefix:
            s.pending.append(Pending(prefix))
        self.sessions[session_id] = s

    def restore_session(self, session_id: str, instructions: str, messages: list[api.Message],
                        admit: bool = False) -> int:
        """Open a session from its transcript: (role, text, closed) per item, oldest first.

        The context becomes the system prompt plus the most recent tokens that
        fit the window (the prefix cache serves every full block an earlier
        sequence shares with it). Returns the transcript's length in tokens.
        `admit`: new work, refused `overloaded` past the daemon's pending limit.
        """
        tokens = self.transcript_tokens(messages)
        keep = tokens[max(0, len(tokens) - (self.manager.window_cap - self.cache_cfg.block_size)):]
        if admit:
            self._check_load(len(keep))
        self.open_session(session_id, instructions)
        s = self.sessions[session_id]
        self.tiering.changed(s)  # no saved copy of an earlier life of this session is current
        s.open_item = bool(messages) and not messages[-1][2]
        s.num_items = len(messages)
        if keep:
            s.pending.append(Pending(keep))
        return len(tokens)

    def transcript_tokens(self, messages: list[api.Message]) -> list[int]:
        """The context a transcript gives after the system prompt, before the window cut."""
        tokens: list[int] = []
        for role, text, closed in messages:
            tokens += self.chat.message(role, text) if closed else self.chat.open_message(role) + self.chat.encode(text)
        return tokens

    def context_tokens(self, session_id: str) -> int:
        """Tokens the session will attend to once its queued work is in (sinks plus window)."""
        s = self._get(session_id)
        sink = s.seq.num_sink_blocks * self.cache_cfg.block_size
        total = len(self.tiering.context_of(s)) + s.queued_tokens
        return min(total, sink + self.manager.window_cap)

    def _system_tokens(self, instructions: str) -> list[int]:
        body = self.chat.message("system", instructions) if instructions else []
        return self.chat.bos_ids + body

    def set_instructions(self, session_id: str, instructions: str) -> None:
        """Replace the pinned system prompt; the rest of the context is kept and rebuilt.

        Queued work keeps its tickets: every item still prefilling is reported when in.
        """
        s = self._get(session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response", "a response is running")
        prefix = self._system_tokens(instructions)
        pinned = len(prefix) if self.cache_cfg.pin_system_prompt else 0
        self.tiering.changed(s)
        self.scheduler.reset(s, pinned, prefix)

    # -- input: prepared (checked, nothing changed), then queued once the store has it ------

    def prepare_item(self, session_id: str, role: str, text: str) -> api.Prepared:
        """Frame a whole message (closing the open append item first); check the limits."""
        s = self._get(session_id)
        close = self.chat.close_message("user") if s.open_item else []
        tokens = close + self.chat.message(role, text)
        self._check_room(s, len(tokens))
        return api.Prepared(session_id, tuple(tokens), closes_item=bool(close), kind="item")

    def prepare_append(self, session_id: str, text: str) -> api.Prepared:
        """Raw text into the open user item (opened by the first append); check the limits."""
        s = self._get(session_id)
        tokens = ([] if s.open_item else self.chat.open_message("user")) + self.chat.encode(text)
        self._check_room(s, len(tokens))
        return api.Prepared(session_id, tuple(tokens), opens_item=not s.open_item, kind="append")

    def _check_room(self, s: EngineSession, num_tokens: int) -> None:
        lim = self.sched_cfg
        if s.queued_tokens + num_tokens > lim.max_pending_tokens_per_session:
            raise EngineError("pending_limit_exceeded",
                              f"this session already has {s.queued_tokens} tokens waiting to enter the cache; "
                              f"at most {lim.max_pending_tokens_per_session} may wait; "
                              f"send more after conversation.item.done")
        self._check_load(num_tokens)

    def _check_load(self, num_tokens: int) -> None:
        lim = self.sched_cfg
        total = sum(v.queued_tokens for v in self.sessions.values())
        if total + num_tokens > lim.max_pending_tokens:
            raise EngineError("overloaded", f"the daemon has {total} tokens waiting to enter the cache; "
                                            f"retry later")

    def queue(self, prepared: api.Prepared, ticket=None) -> int:
        """Queue prepared tokens (the store has them now); returns the context after them."""
        s = self._get(prepared.session_id)
        if prepared.kind == "item":
            if prepared.closes_item != s.open_item:
                raise EngineError("invalid_event", "the open item changed since this item was prepared")
            s.open_item = False
            s.num_items += 1
        else:
            if prepared.opens_item == s.open_item:
                raise EngineError("invalid_event", "the open item changed since this append was prepared")
            s.num_items += prepared.opens_item
            s.open_item = True
        self._queue(s, Pending(list(prepared.token_ids), ticket))
        return self.context_tokens(s.session_id)

    def add_item(self, session_id: str, role: str, text: str, ticket=None) -> int:
        """Frame and queue a whole message; returns its token count (in-process callers)."""
        prepared = self.prepare_item(session_id, role, text)
        self.queue(prepared, ticket)
        return len(prepared.token_ids)

    def append_text(self, session_id: str, text: str, ticket=None) -> int:
        """Raw text into the open user item; returns tokens added (in-process callers)."""
        prepared = self.prepare_append(session_id, text)
        self.queue(prepared, ticket)
        return len(prepared.token_ids)

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

    def _queue(self, s: EngineSession, work: Pending) -> None:
        self.tiering.wake(s)
        if s.response is not None:
            s.deferred.append(work)  # joins the context after the running response
        else:
            s.pending.append(work)

    # -- responses ---------------------------------------------------------------------

    def start_response(self, session_id: str, response_id: str, params: SamplingParams,
                       max_tokens: int | None = None, stop: tuple[str, ...] = (),
                       instructions: str | None = None) -> None:
        """Queue a reply. `instructions` are a system message for this turn only: once the
        response ends they leave the context (the reply is recomputed without them)."""
        s = self._get(session_id)
        if s.response is not None:
            raise EngineError("conversation_already_has_active_response",
                              "a response is already running in this session")
        r = Response(response_id, params, max_tokens, IncrementalDetokenizer(self.tokenizer, stop),
                     make_generator(params), created_at=self.clock())
        tokens = self._close_open(s)
        if tokens:
            self._queue(s, Pending(tokens))
        self.tiering.wake(s)
        r.instructions = self.chat.message("system", instructions) if instructions else []
        s.pending.append(Pending(r.instructions + self.chat.reply_prompt(), starts_response=True))
        s.num_items += 1  # the reply is an item of the conversation too
        s.response = r

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
        self.scheduler.forget(s, delete_file=not keep_saved)
        del self.sessions[session_id]
        return events

    def session_stats(self, session_id: str) -> api.SessionStats:
        s = self._get(session_id)
        st = self.manager.stats(s.seq)
        if s.parked is not None:  # in a lower tier: its cache as it will come back
            st = st._replace(context_tokens=len(s.parked.token_ids), evicted_tokens=s.parked.evicted_tokens)
        return api.SessionStats(
            context_tokens=st.context_tokens, total_tokens=s.total_tokens, evicted_tokens=st.evicted_tokens,
            cached_tokens=st.cached_tokens, owned_blocks=st.owned_blocks, shared_blocks=st.shared_blocks,
            pool_cached_free=self.pool.num_cached_free, pool_free=self.pool.num_free,
            prefix_queried_tokens=s.seq.queried_tokens, prefix_hit_tokens=s.seq.cached_tokens,
            kv_bytes=len(s.seq.block_ids) * self.runner.bytes_per_block, items=s.num_items,
            queued_tokens=s.queued_tokens, residency=s.tier, on_disk=self.tiering.on_disk(s),
            eviction=s.seq.eviction)

    def _get(self, session_id: str) -> EngineSession:
        s = self.sessions.get(session_id)
        if s is None:
            raise EngineError("session_not_found", f"no session {session_id}")
        s.last_active = self.clock()
        return s

    # -- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return any(s.pending or s.response for s in self.sessions.values())

    def step(self) -> list[EngineEvent]:
        """Schedule, run the model once, sample, and report what happened.

        Never raises for a failure inside the step: the responses it carried
        fail with `internal` and their sessions are rebuilt from their tokens.
        """
        events = self._expire()
        owners: list[EngineSession] = []
        try:
            sched = self.scheduler.schedule(list(self.sessions.values()))
            owners = sched.owners
            if not sched.batch:  # work served entirely from the prefix cache still completes
                self.failed_steps = 0
                return events + [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
            started = time.perf_counter()
            logits = self._execute(sched)
            events += [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
            samplers = [o for o, c in zip(sched.owners, sched.batch.chunks()) if c.want_logits]
            if samplers:
                tokens = sample(logits, [o.response.params for o in samplers],
                                [o.response.generator for o in samplers], _histories(samplers))
                for s, token in zip(samplers, tokens):
                    events += self._on_token(s, token)
            elapsed = time.perf_counter() - started
            self.scheduler.costs.observe(sched.batch.num_tokens, sched.pairs, elapsed)
            self.metrics.on_step(sched.batch.num_tokens, len(sched.batch.decode), elapsed)
        except Exception as exc:  # noqa: BLE001 - the engine must outlive any one step
            return events + self._recover(owners, exc)
        self.failed_steps = 0
        return events

    def _execute(self, sched) -> object:
        """Run the step; with an h2o session in it, feed every chunk's attention mass to its scores."""
        if not any(s.seq.eviction == "h2o" for s in sched.owners):
            return self.runner.execute(sched.batch)
        logits, masses = self.runner.execute_with_mass(sched.batch)
        for s, chunk, mass in zip(sched.owners, sched.batch.chunks(), masses):
            if s.seq.eviction == "h2o" and s.seq.block_ids == chunk.block_ids:
                self.manager.observe(s.seq, mass, len(chunk.token_ids))
        return logits

    def _recover(self, owners: list[EngineSession], exc: Exception) -> list[EngineEvent]:
        """A step failed: fail its responses, rebuild its sessions from their tokens."""
        self.failed_steps += 1
        self.metrics.failed_steps += 1
        log.error("engine step failed (%d in a row): %r; failing its responses and rebuilding %d sessions",
                  self.failed_steps, exc, len({id(s) for s in owners}), exc_info=exc)
        events: list[EngineEvent] = []
        seen: set[str] = set()
        # owners of a step that failed in scheduling are unknown: every session with a running
        # response may hold a half-placed chunk, so all of those are rebuilt too
        suspects = owners or [s for s in self.sessions.values() if s.response is not None]
        for s in suspects:
            if s.session_id in seen or s.session_id not in self.sessions:
                continue
            seen.add(s.session_id)
            if s.response is not None:
                s.response.next_token = None  # not trusted: the step that would place it failed
                events += self._finish(s, "failed", "internal")
            self.scheduler.rebuild(s)
        return events

    def _expire(self) -> list[EngineEvent]:
        """Responses that made no progress for `queue_timeout_s` fail `overloaded`.

        Progress is any token of the session placed in the cache: a reply
        waiting on its own history's prefill is moving, not waiting.
        """
        now, limit = self.clock(), self.sched_cfg.queue_timeout_s
        events: list[EngineEvent] = []
        for s in list(self.sessions.values()):
            r = s.response
            if r and r.first_token_at is None and now - max(r.created_at, s.progressed_at) > limit:
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
        if r.instructions:
            after = len(self.chat.reply_prompt()) + len(r.output_ids) + len(self.chat.reply_end())
            self.scheduler.drop_turn_instructions(s, r.instructions, after)
        s.pending.extend(s.deferred)
        s.deferred.clear()
        s.computed_this_turn = 0
        events.append(ResponseFinished(s.session_id, r.response_id, status, reason, r.detok.text,
                                       self._usage(s, r), tuple(r.output_ids)))
        return events

    def _usage(self, s: EngineSession, r: Response) -> api.Usage:
        out = len(r.output_ids)
        gen_s = (self.clock() - r.first_token_at) if r.first_token_at else 0.0
        return api.Usage(
            input_tokens=r.input_tokens, cached_tokens=r.cached_tokens, output_tokens=out,
            context_tokens=s.seq.num_tokens, evicted_tokens=s.seq.evicted_tokens,
            ttft_ms=round((r.first_token_at - r.created_at) * 1000, 2) if r.first_token_at else None,
            output_tokens_per_s=round((out - 1) / gen_s, 2) if out > 1 and gen_s > 0 else None)

    def check(self) -> None:
        """Assert the pool and every session's table agree, and the tiers hold what they say."""
        self.manager.check([s.seq for s in self.sessions.values()])
        if self.pager is not None:
            self.pager.check(self.sessions.values())


def _histories(samplers: list[EngineSession]) -> list[TokenHistory] | None:
    """What each sampling row has seen, for the rows whose params penalize it (None: no row does).

    The context's tail already ends with the token placed this step; the reply's
    tokens are its output so far. Rows without penalties get an empty history.
    """
    if not any(s.response.params.penalized for s in samplers):
        return None
    empty = TokenHistory((), ())
    return [TokenHistory(s.seq.token_ids[-REPETITION_WINDOW:], s.response.output_ids)
            if s.response.params.penalized else empty for s in samplers]


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
