"""The scheduler: each step's batch, and (through its placer) where every session's KV lives.

Owns which sessions run this step, how many tokens each gets, and making
room when the pool is full (idle sessions give up their blocks first, then
the newest running work is preempted and re-queued). Its `placer`
(engine.placement) is the one owner of sessions' residency. Torch-free: it
moves token ids and block ids, never tensors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from streamchat.cache.manager import KVCacheManager
from streamchat.config import SchedulerConfig
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.engine.costs import StepCosts
from streamchat.engine.placement import Placer
from streamchat.engine.session import EngineSession, Pending, Phase

log = logging.getLogger(__name__)


@dataclass
class Scheduled:
    batch: StepBatch
    owners: list[EngineSession] = field(default_factory=list)  # one per chunk, batch order
    tickets: list[tuple[EngineSession, object]] = field(default_factory=list)  # done after the step
    pairs: int = 0  # query-key pairs of the step's attention, for the cost model


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    idle_drops: int = 0
    tokens_scheduled: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, manager: KVCacheManager, pager=None,
                 sessions: dict[str, EngineSession] | None = None, sync_io: bool = True) -> None:
        self.cfg = cfg
        self.manager = manager
        self.stats = SchedulerStats()
        self.sessions = sessions if sessions is not None else {}
        # sessions with work (queued tokens or a response), in the order they got it: what a step looks at,
        # so idle sessions cost a step nothing however many there are
        self.active: dict[str, EngineSession] = {}
        self.placer = Placer(manager, pager, self.sessions, self.stats, sync_io, self.activate)
        self._rr = 0  # round-robin start for prefill
        self.costs = StepCosts()  # learned from every step the engine runs
        self.clock = time.monotonic

    @property
    def pager(self):
        return self.placer.pager

    def activate(self, s: EngineSession) -> None:
        """`s` has work now: the steps look at it until it has none."""
        self.active.setdefault(s.session_id, s)

    def prune(self) -> None:
        """Forget the sessions whose work is done (or that were closed)."""
        for sid in [sid for sid, s in self.active.items() if not s.busy or self.sessions.get(sid) is not s]:
            del self.active[sid]

    def schedule(self, sessions: list[EngineSession]) -> Scheduled:
        """Pick this step's work. `sessions` is in arrival order (oldest first); only those whose
        KV is on the device run (a session whose file is being read waits for it)."""
        out = Scheduled(StepBatch())
        self._admit(sessions)
        budget = self.cfg.max_tokens_per_step
        for s in sessions:
            if budget and s.decoding and self._make_room(s, 1, sessions, out.owners):
                self._add(out, s, [s.response.next_token], decode=True)
                s.response.next_token = None  # in the cache now; the step samples the next one
                budget -= 1
        seconds = None  # prefill's time in this step: bounded only while sessions stream
        if out.batch.decode:
            decode_s = self.costs.estimate(out.batch.num_tokens, out.pairs)
            seconds = max(self.cfg.target_step_ms / 1000 - decode_s, self.cfg.min_prefill_share * decode_s)
        self._prefill(out, sessions, budget, seconds)
        self.stats.steps += 1
        self.stats.tokens_scheduled += out.batch.num_tokens
        return out

    def _admit(self, sessions: list[EngineSession]) -> None:
        """Move queued responses into PREFILL while running slots are free."""
        running = sum(1 for s in sessions if s.response and s.response.phase is not Phase.QUEUED)
        for s in sessions:
            if running >= self.cfg.max_running:
                return
            if s.response and s.response.phase is Phase.QUEUED:
                s.response.phase = Phase.PREFILL
                running += 1

    def _prefill(self, out: Scheduled, sessions: list[EngineSession], budget: int,
                 seconds: float | None) -> None:
        """Chunks for the sessions with queued tokens, round-robin, under the token budget and,
        while sessions stream, the step's prefill time shared fairly among them.

        Each session gets an equal share of the time left (what one leaves, the next may use),
        but never less than one block's worth: a chunk costs a pass over its whole context, so
        tiny chunks waste it. The round-robin start moves past the sessions served, so over
        a few steps every one gets its turn.
        """
        ready = [s for s in sessions if s.pending and s.resident and self._may_prefill(s)]
        if not ready:
            return
        start = self._rr % len(ready)
        served = 0
        order = ready[start:] + ready[:start]
        for i, s in enumerate(order):
            if budget <= 0 or (seconds is not None and seconds <= 0 and served):
                break
            limit = budget
            if seconds is not None:
                share = seconds / (len(order) - i)
                limit = min(limit, max(self.manager.block_size, self.costs.tokens_within(share, s.seq.num_tokens)))
            before = s.seq.num_tokens
            taken = self._prefill_one(out, s, limit, sessions)
            if taken:
                served += 1
                if seconds is not None:
                    seconds -= self.costs.estimate(taken, taken * (before + taken)) - self.costs.fixed
            budget -= taken
        self._rr += max(served, 1)

    @staticmethod
    def _may_prefill(s: EngineSession) -> bool:
        head = s.pending[0]
        return not head.starts_response or s.response is None or s.response.phase is not Phase.QUEUED

    def _prefill_one(self, out: Scheduled, s: EngineSession, budget: int, sessions) -> int:
        self._take_prefix(out, s)
        tokens, finished, sample = self._collect(s, min(budget, self.manager.max_chunk))
        if tokens and not self._make_room(s, len(tokens), sessions, out.owners):
            return 0
        for p in finished:
            s.pending.popleft()
        if s.pending:
            s.pending[0].done += len(tokens) - sum(p.remaining for p in finished)
        for p in finished:
            p.done = len(p.token_ids)
        if tokens:
            self._add(out, s, tokens, decode=False, want_logits=sample)
        self._report(out, s, finished)
        s.computed_this_turn += len(tokens)
        return len(tokens)

    def _collect(self, s: EngineSession, limit: int) -> tuple[list[int], list[Pending], bool]:
        """Tokens for one chunk from the head of the queue, and the entries it finishes."""
        tokens: list[int] = []
        finished: list[Pending] = []
        for p in s.pending:
            take = p.token_ids[p.done:p.done + limit - len(tokens)]
            tokens += take
            if len(take) < p.remaining:
                return tokens, finished, False
            finished.append(p)
            if p.starts_response:
                return tokens, finished, True
            if len(tokens) >= limit:
                break
        return tokens, finished, False

    def _take_prefix(self, out: Scheduled, s: EngineSession) -> None:
        """Serve the head of the queue from cached blocks where the pool has them.

        The match runs across queued entries, up to the reply's prompt less its
        last token (whose logits start the reply): a replayed conversation is
        queued as its system prompt and then its transcript, and the blocks it
        shares with an earlier request straddle the two.

            queue:  [system prompt] [transcript .......] [reply prompt]
            match:  |blk|blk|blk|blk|blk|blk|blk|blk|..    (full blocks, chained)
        """
        if not s.seq.pristine or s.seq.num_tokens % self.manager.block_size:
            return
        tokens: list[int] = []
        for p in s.pending:
            tokens += p.token_ids[p.done:]
            if p.starts_response:
                tokens.pop()
                break
        taken = self.manager.match_prefix(s.seq, tokens)
        s.total_tokens += taken  # held, though not computed
        while taken:
            head = s.pending[0]
            step = min(taken, head.remaining)
            head.done += step
            taken -= step
            if not head.remaining:
                s.pending.popleft()
                self._report(out, s, [head])

    def _report(self, out: Scheduled, s: EngineSession, finished: list[Pending]) -> None:
        out.tickets.extend((s, p.ticket) for p in finished if p.ticket is not None)

    def _add(self, out: Scheduled, s: EngineSession, tokens: list[int], decode: bool,
             want_logits: bool = True) -> None:
        placed = self.manager.append(s.seq, tokens)
        # Register newly full blocks now: a session scheduled later in this same step may
        # take them. Safe because every layer writes the step's K/V before any attention.
        self.manager.commit(s.seq)
        chunk = SeqChunk(tokens, placed.positions, placed.slots, list(s.seq.block_ids), want_logits)
        (out.batch.decode if decode else out.batch.prefill).append(chunk)
        out.pairs += len(tokens) * s.seq.num_tokens  # query-key pairs its attention computes (about)
        out.owners.append(s)
        s.total_tokens += len(tokens)
        s.progressed_at = self.clock()

    def _make_room(self, s: EngineSession, num_new: int, sessions: list[EngineSession],
                   scheduled: list[EngineSession]) -> bool:
        """True once the pool can take the append; idle sessions give up blocks first, then the
        newest running work is preempted."""
        while not self.manager.can_append(s.seq, num_new):
            victim = self.placer.idle_victim(s, scheduled) or self._running_victim(sessions, s, scheduled)
            if victim is None:
                return False
            self.placer.drop(victim)
        return True

    def _running_victim(self, sessions, me, scheduled) -> EngineSession | None:
        busy = [v for v in sessions if v is not me and v.resident and v.seq.block_ids
                and not any(v is o for o in scheduled)]
        if not busy:
            return None
        self.stats.preemptions += 1
        return busy[-1]  # the newest

    def drop_turn_instructions(self, s: EngineSession, instructions: list[int], num_after: int) -> None:
        """Take a finished response's own system message out of the context.

        The context is the cache followed by the queue; the message sits right
        before the reply (prompt, output, end), the queue's last entries. The
        cache is cut back to the block boundary at or before the message and
        what followed it is queued again, so no block is ever written twice.

            cache:  ...... |blk|  instructions | reply (prompt, output) ...
                           ^cut   ^a            ^b
            queue:  [tokens cut..a] + [reply ...] + rest of the queue
        """
        cache = list(s.seq.token_ids)
        stream = cache + [t for p in s.pending for t in p.token_ids[p.done:]]
        b = len(stream) - num_after
        a = b - len(instructions)
        if a < 0 or stream[a:b] != instructions:
            log.warning("session %s: this turn's instructions were evicted with the reply; "
                        "left as they are", s.session_id)
            return
        self.cut_stream(s, cache, a, b)

    def cut_stream(self, s: EngineSession, cache: list[int], a: int, b: int) -> None:
        """Remove stream[a:b] (stream = cache + queue), re-queuing what the cache cut loses."""
        bs = self.manager.block_size
        requeue: list[int] = []
        if a < len(cache):
            cut = a // bs * bs
            requeue = cache[cut:a] + cache[min(b, len(cache)):]
            self.manager.truncate(s.seq, cut)
        offset = len(cache)
        for p in s.pending:  # the part of [a, b) that is still queued
            rest = p.token_ids[p.done:]
            lo, hi = max(a - offset, 0), min(b - offset, len(rest))
            if lo < hi:
                p.token_ids, p.done = rest[:lo] + rest[hi:], 0
            offset += len(rest)
        if requeue:
            s.pending.appendleft(Pending(requeue))
