"""A small synchronous Python API over the engine, for scripts, benchmarks and tests.

    llm = LLM(Config())
    [reply] = llm.chat(["Hello!"], max_tokens=32)

Owns nothing but convenience: every call goes through the same Engine the
daemon runs, stepped in the caller's thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from streamchat.autotune import measure_weights
from streamchat.config import Config
from streamchat.engine.api import EngineError, Usage
from streamchat.engine.engine import Engine
from streamchat.engine.events import NewTokens, ResponseFinished
from streamchat.engine.outputs import OutputProcessor
from streamchat.model.runner import ModelRunner, load_model
from streamchat.model.sampling import SamplingParams, load_model_defaults


@dataclass
class Reply:
    text: str
    status: str
    reason: str | None
    usage: Usage
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)


class LLM:
    def __init__(self, config: Config | None = None, loaded=None, tiers: bool = False) -> None:
        """`tiers`: page idle sessions to host memory and (when `config.tiers.data_dir` is set) disk."""
        self.config = (config or Config()).validate()
        self.loaded = loaded or load_model(self.config.model, measure=measure_weights)
        self.runner = ModelRunner(self.loaded, self.config.cache, self.config.scheduler.max_running,
                                  self.config.model.cuda_graphs)
        self.engine = Engine(self.runner, self.config.cache, self.config.scheduler,
                             tiers=self.config.tiers if tiers else None, data_dir=self.config.tiers.data_dir)
        self._ids = itertools.count()
        self.outputs = OutputProcessor(self.loaded.tokenizer)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def default_params(self) -> SamplingParams:
        """What the daemon samples with when nobody asks otherwise (`chat` and `respond` stay greedy
        unless given params): the model folder's generation_config.json, else DEFAULT_PARAMS."""
        return load_model_defaults(self.loaded.source.folder)

    def chat(self, prompts: list[str], max_tokens: int = 64, system: str = "",
             params: SamplingParams | None = None, stop: tuple[str, ...] = ()) -> list[Reply]:
        """One user turn per prompt, each in its own new session, batched together."""
        for prompt in prompts:
            if not prompt or not prompt.strip():
                raise ValueError("empty prompt")
        sids = [f"llm-{next(self._ids)}" for _ in prompts]
        for sid, prompt in zip(sids, prompts):
            self.engine.open_session(sid, system)
            self.engine.add_item(sid, "user", prompt)
        replies = self.respond(sids, max_tokens, params, stop)
        for sid in sids:
            self.engine.close_session(sid)
        return replies

    def respond(self, session_ids: list[str], max_tokens: int = 64,
                params: SamplingParams | None = None, stop: tuple[str, ...] = ()) -> list[Reply]:
        """Start a response in each open session and step until all finish."""
        params = (params or SamplingParams()).validate()
        rids = {}
        for sid in session_ids:
            rid = f"resp-{next(self._ids)}"
            self.engine.start_response(sid, rid, params, max_tokens)
            self.outputs.start(rid, stop)
            rids[rid] = sid
        return self.run_until(rids)

    def run_until(self, rids: dict[str, str]) -> list[Reply]:
        """Step until the responses finish; text as the daemon's front makes it (stop strings met)."""
        deltas: dict[str, list[str]] = {rid: [] for rid in rids}
        done: dict[str, Reply] = {}
        while len(done) < len(rids):
            if not self.engine.has_work():
                raise EngineError("internal", "the engine went idle before the responses finished")
            events = self.engine.step()
            while events:
                ev = events.pop(0)
                if isinstance(ev, NewTokens) and ev.response_id in deltas:
                    delta, stop = self.outputs.tokens(ev)
                    if delta is not None:
                        deltas[ev.response_id].append(delta.text)
                    if stop is not None:
                        events += self.engine.stop_response(stop.session_id, stop.response_id, stop.num_tokens)
                elif isinstance(ev, ResponseFinished) and ev.response_id in rids:
                    delta, ev = self.outputs.finished(ev)
                    if delta is not None:
                        deltas[ev.response_id].append(delta.text)
                    done[ev.response_id] = Reply(ev.text, ev.status, ev.reason, ev.usage,
                                                 list(ev.token_ids), deltas[ev.response_id])
        return [done[rid] for rid in rids]

    def drain(self) -> None:
        """Step until nothing is pending (background prefill included)."""
        while self.engine.has_work():
            self.engine.step()
