"""Tests for the engine: batching never changes greedy output, memory pressure, cancellation."""

import pytest
import torch

from streamchat.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from streamchat.engine.engine import EngineError
from streamchat.engine.events import ItemPrefilled, ResponseFinished
from streamchat.llm import LLM
from streamchat.model.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in three sentences.",
    "List three fruits.",
    "Who wrote Hamlet?",
]


def make_llm(loaded, num_blocks=512, budget=256, max_running=64, window=2048, eviction="sink_window",
             kv_dtype="auto"):
    cfg = Config(model=ModelConfig(dtype="float32"),
                 cache=CacheConfig(num_blocks=num_blocks, window_tokens=window, eviction=eviction,
                                   h2o_recent_tokens=min(256, window - 32), kv_dtype=kv_dtype),
                 # queue timeouts are tested on their own; a slow (shared) machine must not trip them here
                 scheduler=SchedulerConfig(max_tokens_per_step=budget, max_running=max_running,
                                           queue_timeout_s=3600.0))
    return LLM(cfg, loaded=loaded)


def step_checked(engine):
    events = engine.step()
    engine.check()
    return events


def test_greedy_generation_equals_transformers(bundled_fp32, hf_bundled_fp32):
    """32 greedy tokens on 5 chat prompts equal transformers' generate, token for token."""
    llm = make_llm(bundled_fp32)
    replies = llm.chat(PROMPTS, max_tokens=32)
    chat = llm.engine.chat
    for prompt, reply in zip(PROMPTS, replies):
        ids = chat.bos_ids + chat.message("user", prompt) + chat.reply_prompt()
        out = hf_bundled_fp32.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        expected = out[0, len(ids):].tolist()
        if expected[-1] in llm.engine.eos_ids:
            expected = expected[:-1]
        assert reply.token_ids == expected
        assert "".join(reply.deltas) == reply.text
        assert reply.status == ("incomplete" if len(expected) == 32 else "completed")


@pytest.fixture(scope="module")
def alone(bundled_fp32):
    """Each of 16 sessions' greedy reply computed alone."""
    llm = make_llm(bundled_fp32)
    return [llm.chat([p], max_tokens=24)[0].token_ids for p in prompts16()]


def prompts16():
    return [f"{PROMPTS[i % 5]} " + "Please answer carefully. " * (i % 4) for i in range(16)]


def test_batched_with_interleaved_prefill_equals_alone(bundled_fp32, alone):
    """16 sessions of different lengths, started at different steps, in small chunks: same tokens."""
    llm = make_llm(bundled_fp32, budget=40)
    eng = llm.engine
    done = {}

    def step():
        for ev in step_checked(eng):
            if isinstance(ev, ResponseFinished):
                done[ev.response_id] = list(ev.token_ids)

    for i, prompt in enumerate(prompts16()):
        eng.open_session(f"s{i}")
        eng.add_item(f"s{i}", "user", prompt)
        eng.start_response(f"s{i}", f"r{i}", SamplingParams(), max_tokens=24)
        if i % 4 == 3:  # later sessions arrive while earlier ones decode
            for _ in range(3):
                step()
    while len(done) < 16:
        assert eng.has_work()
        step()
    assert [done[f"r{i}"] for i in range(16)] == alone
    assert max(eng.metrics.batch_sizes) <= 40


@pytest.mark.parametrize("eviction", ["sink_window", "h2o"])
def test_pool_exhaustion_preempts_and_completes_everything(bundled_fp32, alone, eviction):
    """A pool far too small for 16 sessions: all finish correctly, preemptions counted, no leak
    (h2o: the scores' explicit attention gives the same greedy tokens as SDPA)."""
    llm = make_llm(bundled_fp32, num_blocks=16, budget=64, window=128, eviction=eviction)
    eng = llm.engine
    for i, prompt in enumerate(prompts16()):
        eng.open_session(f"s{i}")
        eng.add_item(f"s{i}", "user", prompt)
        eng.start_response(f"s{i}", f"r{i}", SamplingParams(), max_tokens=24)
    done = {}
    while len(done) < 16:
        assert eng.has_work()
        for ev in step_checked(eng):
            if isinstance(ev, ResponseFinished):
                done[ev.response_id] = list(ev.token_ids)
    assert eng.scheduler.stats.preemptions + eng.scheduler.stats.idle_drops > 0
    assert [done[f"r{i}"] for i in range(16)] == alone
    for i in range(16):
        eng.close_session(f"s{i}")
    assert eng.pool.num_used == 0
    eng.check()


def test_cancel_and_close_return_blocks_and_engine_keeps_serving(bundled_fp32):
    """Cancel mid-response ends it `cancelled`; closing a session frees every block."""
    llm = make_llm(bundled_fp32)
    eng = llm.engine
    for sid in ("a", "b"):
        eng.open_session(sid)
        eng.add_item(sid, "user", "Tell me a long story about a dragon.")
        eng.start_response(sid, "r" + sid, SamplingParams(), max_tokens=40)
    for _ in range(6):
        step_checked(eng)
    [*deltas, fin] = eng.cancel_response("a")
    assert isinstance(fin, ResponseFinished) and fin.status == "cancelled"
    assert fin.reason == "client_cancelled" and fin.usage.output_tokens >= 1
    assert eng.cancel_response("a") == []
    with pytest.raises(EngineError) as err:
        eng.start_response("b", "again", SamplingParams())
    assert err.value.code == "conversation_already_has_active_response"
    finished = []
    while not finished:
        finished = [e for e in step_checked(eng) if isinstance(e, ResponseFinished)]
    assert finished[0].response_id == "rb" and finished[0].status == "incomplete"
    eng.close_session("a")
    eng.close_session("b")
    assert eng.pool.num_used == 0, "closed sessions hold no block (cached ones are free)"
    assert all(c == 0 for c in eng.pool.ref_counts)
    eng.check()


def test_turns_prefill_only_new_tokens_and_report_cached(bundled_fp32):
    """A second turn reuses the whole first turn's cache: cached_tokens counts it."""
    llm = make_llm(bundled_fp32)
    eng = llm.engine
    eng.open_session("s", "You are terse.")
    eng.add_item("s", "user", "Name a color.")
    [first] = llm.respond(["s"], max_tokens=8)
    context_after_first = eng.session_stats("s").context_tokens
    eng.add_item("s", "user", "Another one.")
    [second] = llm.respond(["s"], max_tokens=8)
    assert second.usage.cached_tokens >= context_after_first - 1
    assert second.usage.input_tokens > first.usage.input_tokens


def test_prefilled_tickets_report_in_order(bundled_fp32):
    """Items are acknowledged (ItemPrefilled) once in the cache, in submission order."""
    llm = make_llm(bundled_fp32, budget=16)
    eng = llm.engine
    eng.open_session("s")
    eng.add_item("s", "user", "one " * 20, ticket=1)
    eng.append_text("s", "two three", ticket=2)
    eng.commit_text("s", ticket=3)
    seen = []
    while eng.has_work():
        seen += [e.ticket for e in step_checked(eng) if isinstance(e, ItemPrefilled)]
    assert seen == [1, 2, 3]


def test_unknown_session_and_window_too_big_for_pool(bundled_fp32):
    """Unknown ids raise session_not_found; a window larger than the pool is a config error."""
    from streamchat.config import ConfigError

    llm = make_llm(bundled_fp32)
    with pytest.raises(EngineError) as err:
        llm.engine.add_item("nope", "user", "hi")
    assert err.value.code == "session_not_found"
    with pytest.raises(ConfigError, match="larger|only"):
        make_llm(bundled_fp32, num_blocks=16, window=2048)
    with pytest.raises(ValueError, match="empty"):
        llm.chat([""])


def test_stop_strings_and_deltas_concatenate(bundled_fp32):
    """A stop string ends the reply before it; deltas concatenate to the final text."""
    llm = make_llm(bundled_fp32)
    [free] = llm.chat(["List three fruits."], max_tokens=30)
    word = free.text.split()[1]
    [stopped] = llm.chat(["List three fruits."], max_tokens=30, stop=(word,))
    assert stopped.text == free.text[:free.text.index(word)]
    assert "".join(stopped.deltas) == stopped.text


def test_seeded_sampling_is_reproducible(bundled_fp32):
    """The same seed gives the same sampled tokens; another seed gives other tokens (checked once for
    these seeds: the draw is deterministic, so this cannot flake)."""
    import dataclasses

    llm = make_llm(bundled_fp32)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = llm.chat(["Tell me a story."], max_tokens=16, params=p)[0].token_ids
    b = llm.chat(["Tell me a story."], max_tokens=16, params=p)[0].token_ids
    c = llm.chat(["Tell me a story."], max_tokens=16, params=dataclasses.replace(p, seed=8))[0].token_ids
    assert a == b
    assert c != a, "another seed drew the same 16 tokens: the seed is not used"


def test_penalized_rows_get_their_history_and_others_none(bundled_fp32, monkeypatch):
    """The step hands `sample` the context tail and reply of each penalized row, an empty history
    to the others, and no history at all when no row is penalized; the penalty changes the reply."""
    import streamchat.engine.step as engine_module
    from streamchat.model.sampling import REPETITION_WINDOW, TokenHistory

    llm = make_llm(bundled_fp32)
    calls = []
    original = engine_module.sample

    def spy(logits, params, generators, history=None):
        sessions = {s.response.params: s for s in llm.engine.sessions.values() if s.response is not None}
        expected = [TokenHistory(list(sessions[p].seq.token_ids[-REPETITION_WINDOW:]),
                                 list(sessions[p].response.output_ids)) if p.penalized else TokenHistory([], [])
                    for p in params]
        seen = None if history is None else [TokenHistory(list(h.recent), list(h.generated)) for h in history]
        calls.append((seen, expected, [p.penalized for p in params]))
        return original(logits, params, generators, history)

    monkeypatch.setattr(engine_module, "sample", spy)
    plain = SamplingParams()
    [greedy] = llm.chat(["List three fruits."], max_tokens=24, params=plain)
    assert calls and all(h is None for h, _, _ in calls)
    calls.clear()
    penalized = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    eng = llm.engine
    for sid, params in (("pen", penalized), ("plain", plain)):  # one batch, one row of each
        eng.open_session(sid)
        eng.add_item(sid, "user", "List three fruits.")
        eng.start_response(sid, "r-" + sid, params, 24)
    replies = llm.run_until({"r-pen": "pen", "r-plain": "plain"})
    assert calls and all(h is not None for h, _, _ in calls)
    assert any(flags == [True, False] or flags == [False, True] for _, _, flags in calls)
    for history, expected, _ in calls:
        assert history == expected
    assert any(len(h.generated) > 0 for history, _, _ in calls for h in history)
    pen, again = replies
    assert again.token_ids == greedy.token_ids  # the plain row beside a penalized one: plain greedy
    assert pen.token_ids != greedy.token_ids


def test_a_late_stop_cuts_the_tokens_sampled_past_it(bundled_fp32):
    """The front meets a stop string at token 3 while the engine has sampled 8: the reply ends
    there (completed), and the tokens past it leave the context, which ends with the reply's end."""
    from streamchat.engine.events import NewTokens

    llm = make_llm(bundled_fp32)
    eng = llm.engine
    eng.open_session("s")
    eng.add_item("s", "user", "List three fruits.")
    eng.start_response("s", "r", SamplingParams(), 30)
    out = []
    while len(out) < 8:
        out += [t for ev in step_checked(eng) if isinstance(ev, NewTokens) for t in ev.token_ids]
    [fin] = eng.stop_response("s", "r", 3)
    assert (fin.status, fin.reason, list(fin.token_ids)) == ("completed", None, out[:3])
    llm.drain()
    eng.check()
    chat = eng.chat
    expected = chat.system_prefix("") + chat.message("user", "List three fruits.") + chat.reply_prompt()
    assert eng.sessions["s"].seq.token_ids == expected + out[:3] + chat.reply_end()


def test_a_stop_in_the_newest_token_keeps_it(bundled_fp32):
    """A stop met in the token sampled last (not yet in the cache) keeps that token in the context."""
    from streamchat.engine.events import NewTokens

    llm = make_llm(bundled_fp32)
    eng = llm.engine
    eng.open_session("s")
    eng.add_item("s", "user", "List three fruits.")
    eng.start_response("s", "r", SamplingParams(), 30)
    out = []
    while len(out) < 5:
        out += [t for ev in step_checked(eng) if isinstance(ev, NewTokens) for t in ev.token_ids]
    [fin] = eng.stop_response("s", "r", len(out))
    assert list(fin.token_ids) == out
    llm.drain()
    chat = eng.chat
    expected = chat.system_prefix("") + chat.message("user", "List three fruits.") + chat.reply_prompt()
    assert eng.sessions["s"].seq.token_ids == expected + out + chat.reply_end()


# -- every KV storage under both policies, evicting -------------------------------------------------

KV_DTYPES = ["float", "int8", "fp8", "int4"]
# int4 is the fragile one: a key block is re-quantized as it fills, so a last-bit difference in a key can move
# a code by a whole step. Until the grouped products gave a row the same bits at any row count (2026-12-05),
# int4/sink_window's batched run left the alone run after 4 tokens on an Intel Xeon and at one thread on the
# AMD EPYC; these prompts passed there only by luck.
# Framed, 52 and 47 tokens: with 8 reply tokens both pass one sink block plus a 32-token window.
EVICTING = [
    "Describe the water cycle in a few sentences: how the sun warms the sea, how the vapour rises and "
    "forms clouds, how rain falls on the hills, and how the rivers carry it back to the sea again.",
    "Explain to a child how a bicycle stays upright while it moves along a road, why it falls over "
    "when it stops, and what the rider does with the handlebars to keep it balanced.",
]


@pytest.mark.parametrize("eviction", ["sink_window", "h2o"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_batched_equals_alone_while_evicting(bundled_fp32, kv_dtype, eviction):
    """Each KV storage under each policy, a 32-token window: two sessions started at different
    steps and batched in 16-token chunks give each one's greedy tokens alone, and both runs evicted
    blocks of every session by that policy only."""
    def llm():
        return make_llm(bundled_fp32, num_blocks=24, budget=16, window=32, eviction=eviction, kv_dtype=kv_dtype)

    first = llm()
    alone = [first.chat([p], max_tokens=8)[0] for p in EVICTING]
    second = llm()
    eng = second.engine
    for i, prompt in enumerate(EVICTING):
        eng.open_session(f"s{i}")
        eng.add_item(f"s{i}", "user", prompt)
        eng.start_response(f"s{i}", f"r{i}", SamplingParams(), max_tokens=8)
        step_checked(eng)  # the next session arrives while this one prefills
    done = {}
    while len(done) < len(EVICTING):
        assert eng.has_work()
        done |= {ev.response_id: ev for ev in step_checked(eng) if isinstance(ev, ResponseFinished)}
    batched = [done[f"r{i}"] for i in range(len(EVICTING))]
    assert [list(r.token_ids) for r in batched] == [r.token_ids for r in alone]
    assert all(r.usage.evicted_tokens > 0 for r in alone)
    assert [r.usage.evicted_tokens for r in batched] == [r.usage.evicted_tokens for r in alone]
    other = "h2o" if eviction == "sink_window" else "sink_window"
    for run in (first, second):
        by_policy = run.engine.manager.evicted_by_policy
        assert by_policy[eviction] == run.engine.manager.num_evicted_tokens > 0 and not by_policy.get(other)
    assert second.runner.kv_dtype == kv_dtype
