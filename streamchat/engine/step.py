"""One engine step and the life of a response: schedule -> run -> sample -> events.

Owns turning a step's logits into tokens and finished responses: sampling,
end of sequence, the token limit, the front's stop (the reply cut at a
token), cancel, responses that wait too long, and a step that fails (its
responses fail, its sessions are rebuilt from their tokens; the engine
serves on). Reports token ids only: text is the front's. Runs on the
engine's one thread; does no I/O.
"""

from __future__ import annotations

import logging
import time

from streamchat.engine import api
from streamchat.engine.events import EngineEvent, ItemPrefilled, NewTokens, ResponseFinished, TokenLogprobs
from streamchat.engine.session import EngineSession, Pending, Phase, Response
from streamchat.model.sampling import REPETITION_WINDOW, TokenHistory, sample, sample_with_logprobs

log = logging.getLogger(__name__)


class Stepper:
    def __init__(self, engine) -> None:
        self.eng = engine

    def step(self) -> list[EngineEvent]:
        """Schedule, run the model once, sample, and report what happened.

        Never raises for a failure inside the step: the responses it carried
        fail with `internal` and their sessions are rebuilt from their tokens.
        """
        eng = self.eng
        events = self.expire()
        owners: list[EngineSession] = []
        try:
            sched = eng.scheduler.schedule(list(eng.scheduler.active.values()))
            owners = sched.owners
            if not sched.batch:  # work served entirely from the prefix cache still completes
                eng.failed_steps = 0
                return events + [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
            started = time.perf_counter()
            logits = self._execute(sched)
            events += [ItemPrefilled(s.session_id, t, s.seq.num_tokens) for s, t in sched.tickets]
            samplers = [o for o, c in zip(sched.owners, sched.batch.chunks()) if c.want_logits]
            for s, token, logprobs in _sample(logits, samplers):
                events += self.on_token(s, token, logprobs)
            elapsed = time.perf_counter() - started
            eng.scheduler.costs.observe(sched.batch.num_tokens, sched.pairs, elapsed)
            eng.metrics.on_step(sched.batch.num_tokens, len(sched.batch.decode), elapsed)
        except Exception as exc:  # noqa: BLE001 - the engine must outlive any one step
            return events + self.recover(owners, exc)
        eng.failed_steps = 0
        return events

    def _execute(self, sched) -> object:
        """Run the step; with an h2o session in it, feed every chunk's attention mass to its scores."""
        eng = self.eng
        if not any(s.seq.eviction == "h2o" for s in sched.owners):
            return eng.runner.execute(sched.batch)
        logits, masses = eng.runner.execute_with_mass(sched.batch)
        for s, chunk, mass in zip(sched.owners, sched.batch.chunks(), masses):
            if s.seq.eviction == "h2o" and s.seq.block_ids == chunk.block_ids:
                eng.manager.observe(s.seq, mass, len(chunk.token_ids))
        return logits

    def recover(self, owners: list[EngineSession], exc: Exception) -> list[EngineEvent]:
        """A step failed: fail its responses, rebuild its sessions from their tokens."""
        eng = self.eng
        eng.failed_steps += 1
        eng.metrics.failed_steps += 1
        log.error("engine step failed (%d in a row): %r; failing its responses and rebuilding %d sessions",
                  eng.failed_steps, exc, len({id(s) for s in owners}), exc_info=exc)
        events: list[EngineEvent] = []
        seen: set[str] = set()
        # owners of a step that failed in scheduling are unknown: every session with a running
        # response may hold a half-placed chunk, so all of those are rebuilt too
        suspects = owners or [s for s in eng.scheduler.active.values() if s.response is not None]
        for s in suspects:
            if s.session_id in seen or s.session_id not in eng.sessions:
                continue
            seen.add(s.session_id)
            if s.response is not None:
                s.response.next_token = None  # not trusted: the step that would place it failed
                events += self.finish(s, "failed", "internal")
            eng.scheduler.placer.rebuild(s)
        return events

    def expire(self) -> list[EngineEvent]:
        """Responses that made no progress for `queue_timeout_s` fail `overloaded`.

        Progress is any token of the session placed in the cache: a reply
        waiting on its own history's prefill is moving, not waiting.
        """
        eng = self.eng
        now, limit = eng.clock(), eng.sched_cfg.queue_timeout_s
        events: list[EngineEvent] = []
        for s in list(eng.scheduler.active.values()):
            r = s.response
            if r and r.first_token_at is None and now - max(r.created_at, s.progressed_at) > limit:
                events += self.finish(s, "failed", "overloaded")
        return events

    def on_token(self, s: EngineSession, token: int, logprobs: TokenLogprobs | None = None) -> list[EngineEvent]:
        eng, r = self.eng, s.response
        now = eng.clock()
        if r.phase is not Phase.DECODE:
            r.phase, r.first_token_at = Phase.DECODE, now
            r.input_tokens = s.seq.num_tokens
            r.cached_tokens = max(0, r.input_tokens - s.computed_this_turn)
            eng.metrics.on_first_token(now - r.created_at)
        else:
            eng.metrics.on_token_gap(now - r.last_token_at)
        r.last_token_at = now
        if token in eng.eos_ids:
            return self.finish(s, "completed", None)
        r.output_ids.append(token)
        r.next_token = token
        events: list[EngineEvent] = [NewTokens(s.session_id, r.response_id, (token,),
                                               () if logprobs is None else (logprobs,))]
        if r.max_tokens is not None and len(r.output_ids) >= r.max_tokens:
            return events + self.finish(s, "incomplete", "max_output_tokens")
        return events

    def stop(self, s: EngineSession, response_id: str, num_tokens: int) -> list[EngineEvent]:
        """The front met a stop string at the reply's token `num_tokens`: end the reply there."""
        r = s.response
        if r is None or r.response_id != response_id:
            return []  # it finished already
        num_tokens = min(num_tokens, len(r.output_ids))
        # the reply's tokens in the cache are all but the newest one (placed by the next step)
        placed_after = len(r.output_ids) - num_tokens - (r.next_token is not None)
        del r.output_ids[num_tokens:]
        r.next_token = r.output_ids[-1] if placed_after < 0 else None  # the stop is in the newest token
        if placed_after > 0:  # sampled past the stop and already placed: they leave the context
            cache = list(s.seq.token_ids)
            self.eng.scheduler.cut_stream(s, cache, len(cache) - placed_after, len(cache))
        return self.finish(s, "completed", None)

    def finish(self, s: EngineSession, status: str, reason: str | None) -> list[EngineEvent]:
        eng, r = self.eng, s.response
        tail = [r.next_token] if r.next_token is not None else []
        s.response = None
        for p in s.pending:  # a reply cut before its first token: its prompt stays plain context
            p.starts_response = False
        s.pending.append(Pending(tail + eng.chat.reply_end()))
        if r.instructions:
            after = len(eng.chat.reply_prompt()) + len(r.output_ids) + len(eng.chat.reply_end())
            eng.scheduler.drop_turn_instructions(s, r.instructions, after)
        s.pending.extend(s.deferred)
        s.deferred.clear()
        s.computed_this_turn = 0
        return [ResponseFinished(s.session_id, r.response_id, status, reason, self._usage(s, r),
                                 tuple(r.output_ids))]

    def _usage(self, s: EngineSession, r: Response) -> api.Usage:
        out = len(r.output_ids)
        gen_s = (self.eng.clock() - r.first_token_at) if r.first_token_at else 0.0
        return api.Usage(
            input_tokens=r.input_tokens, cached_tokens=r.cached_tokens, output_tokens=out,
            context_tokens=s.seq.num_tokens, evicted_tokens=s.seq.evicted_tokens,
            ttft_ms=round((r.first_token_at - r.created_at) * 1000, 2) if r.first_token_at else None,
            output_tokens_per_s=round((out - 1) / gen_s, 2) if out > 1 and gen_s > 0 else None)


def _sample(logits, samplers: list[EngineSession]) -> list[tuple[EngineSession, int, TokenLogprobs | None]]:
    """Each sampling row's token, and its log-probabilities when its params ask (only then computed)."""
    if not samplers:
        return []
    params = [s.response.params for s in samplers]
    generators = [s.response.generator for s in samplers]
    if all(p.logprobs is None for p in params):
        return [(s, token, None) for s, token in zip(samplers, sample(logits, params, generators,
                                                                       _histories(samplers)))]
    drawn = sample_with_logprobs(logits, params, generators, _histories(samplers))
    return [(s, d.token, None if d.logprobs is None else
             TokenLogprobs(d.logprobs.logprob, tuple((t.token, t.logprob) for t in d.logprobs.top)))
            for s, d in zip(samplers, drawn)]


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
