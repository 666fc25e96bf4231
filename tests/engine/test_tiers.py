"""Tests of the session tiers in the engine: idle sessions page out to host and disk and back, exactly.

Every test runs under both eviction policies (they differ only in the victim; h2o's scores travel
with the session through the tiers)."""

import pytest
import torch

from streamchat.config import CacheConfig, Config, ModelConfig, SchedulerConfig, TierConfig
from streamchat.engine import api
from streamchat.engine.events import ResponseFinished
from streamchat.llm import LLM
from streamchat.model.sampling import SamplingParams
from streamchat.tiers.residency import Residency

DEVICE, HOST, DISK = Residency.DEVICE, Residency.HOST, Residency.DISK

pytestmark = pytest.mark.slow

QUESTIONS = ["Name a planet.", "What colour is the sky?", "Say a word for happy.",
             "Count to three.", "Name a fruit."]
FOLLOW_UPS = ["And another one?", "Why is that?"]


@pytest.fixture(scope="module", params=["sink_window", "h2o"])
def eviction(request):
    return request.param


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_llm(loaded, num_blocks, eviction, host_blocks=0, data_dir=None, window=32, kv_dtype="auto"):
    from streamchat.kernels import quant

    per_block = 16 * quant.bytes_per_token(kv_dtype, torch.float32, 30, 3, 64)  # SmolLM2: one 16-token block
    cfg = Config(model=ModelConfig(dtype="float32"),
                 cache=CacheConfig(num_blocks=num_blocks, window_tokens=window, eviction=eviction,
                                   h2o_recent_tokens=window - 32, kv_dtype=kv_dtype),
                 scheduler=SchedulerConfig(max_tokens_per_step=128),
                 tiers=TierConfig(host_tier_gib=host_blocks * per_block / (1 << 30),
                                  disk_tier_gib=1.0 if data_dir else 0.0,
                                  data_dir=str(data_dir) if data_dir else None))
    llm = LLM(cfg, loaded=loaded, tiers=True)
    assert llm.runner.bytes_per_block == per_block
    return llm


def turn(eng, sid, text, max_tokens=6):
    """One user item and a greedy reply, stepped to idle with check() after every step."""
    eng.add_item(sid, "user", text)
    eng.check()
    eng.start_response(sid, f"r-{sid}-{text}", SamplingParams(), max_tokens=max_tokens)
    eng.check()
    reply = None
    while eng.has_work():
        for ev in eng.step():
            if isinstance(ev, ResponseFinished):
                reply = list(ev.token_ids)
        eng.check()
    return reply


def rounds(eng, num_sessions, num_rounds=3):
    """Every session takes a turn in turn, `num_rounds` rounds; the replies by round and session."""
    for i in range(num_sessions):
        eng.open_session(f"s{i}", "You are terse." if i % 2 else "")
    out = []
    for r in range(num_rounds):
        out.append([turn(eng, f"s{i}", QUESTIONS[i] if r == 0 else FOLLOW_UPS[r - 1])
                    for i in range(num_sessions)])
    return out


@pytest.fixture(scope="module")
def reference(bundled_fp32, eviction):
    """The replies with a pool big enough that nothing ever pages out."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return rounds(make_llm(bundled_fp32, num_blocks=200, eviction=eviction).engine, 5)
    finally:
        torch.set_num_threads(before)


def test_tiny_pool_pages_sessions_through_host_and_disk_exactly(bundled_fp32, reference, tmp_path, eviction):
    """5 sessions in a pool for 2, a host tier for 1: all go down and come back, every reply the same."""
    llm = make_llm(bundled_fp32, num_blocks=9, eviction=eviction, host_blocks=5, data_dir=tmp_path)
    eng = llm.engine
    assert rounds(eng, 5) == reference
    moves = eng.pager.moves
    assert moves[(DEVICE, HOST)] and moves[(HOST, DISK)] and moves[(HOST, DEVICE)]
    assert moves[(DISK, DEVICE)] or moves[(DEVICE, DISK)]
    assert eng.scheduler.stats.idle_drops == 0 and eng.scheduler.stats.preemptions == 0
    assert {s.residency for s in eng.sessions.values()} >= {"device"}
    assert eng.session_stats("s0").evicted_tokens > 0 and eng.session_stats("s0").eviction == eviction
    assert eng.manager.evicted_by_policy[eviction] == eng.manager.num_evicted_tokens > 0
    if eviction == "h2o":  # every session's scores, in the pool or parked in a tier with its blocks
        scores = [s.seq.block_scores if s.resident else s.parked.block_scores for s in eng.sessions.values()]
        assert all(any(x > 0 for x in sc) for sc in scores), scores
    for i in range(5):
        eng.close_session(f"s{i}")
    eng.check()
    eng.pager.flush()
    assert all(c == 0 for c in eng.pool.ref_counts)
    assert all(c == 0 for c in eng.pager.host.pool.ref_counts)
    assert [p.name for p in tmp_path.iterdir()] == [".streamchat-data-dir"]  # every session file deleted


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
def test_quantized_sessions_page_through_host_and_disk_exactly(bundled_fp32, tmp_path, eviction, kv_dtype):
    """The test above with each quantized storage (its scale tensors travel with the blocks), made
    cheaper: 3 sessions in a pool for 1, a host tier for 1, two rounds, every reply the same as with
    a pool where nothing pages out, and evictions by the policy in both runs."""
    big = make_llm(bundled_fp32, num_blocks=40, eviction=eviction, kv_dtype=kv_dtype)
    reference = rounds(big.engine, 3, num_rounds=2)
    llm = make_llm(bundled_fp32, num_blocks=6, eviction=eviction, host_blocks=4, data_dir=tmp_path,
                   kv_dtype=kv_dtype)
    eng = llm.engine
    assert rounds(eng, 3, num_rounds=2) == reference
    moves = eng.pager.moves
    assert moves[(DEVICE, HOST)] and moves[(HOST, DISK)] and (moves[(DISK, DEVICE)] or moves[(DEVICE, DISK)])
    assert eng.scheduler.stats.idle_drops == 0 and eng.scheduler.stats.preemptions == 0
    for run in (big, llm):
        assert run.engine.manager.evicted_by_policy[eviction] == run.engine.manager.num_evicted_tokens > 0
    assert llm.runner.kv_dtype == kv_dtype


def test_pristine_sessions_share_prefix_blocks_in_host_and_on_page_in(bundled_fp32, eviction):
    """Two sessions with one system prompt: one host copy of its blocks, one device copy again after
    a prefetch (a) and an item (b) bring them back, and the same replies as never paged out."""
    system = ("You are a patient assistant. You answer every question in one short sentence, "
              "you never use lists, and you end every answer with a full stop.")
    big = make_llm(bundled_fp32, num_blocks=200, eviction=eviction, window=256)
    small = make_llm(bundled_fp32, num_blocks=200, eviction=eviction, host_blocks=40, window=256)
    replies = {}
    for llm in (big, small):
        eng = llm.engine
        for sid, question in (("a", "Name a planet."), ("b", "Name a river.")):
            eng.open_session(sid, system)
            replies[llm, sid, 0] = turn(eng, sid, question)
        a, b = eng.sessions["a"], eng.sessions["b"]
        shared = a.pinned_tokens // 16  # the system prompt's full blocks, b took them from a
        assert shared >= 2 and a.seq.block_ids[:shared] == b.seq.block_ids[:shared]
        assert a.seq.block_ids[shared] != b.seq.block_ids[shared]
        if llm is small:
            blocks = len(a.seq.block_ids) + len(b.seq.block_ids)
            before = list(a.seq.block_ids)
            eng.placer.drop(b)
            eng.placer.drop(a)
            eng.check()
            assert (a.residency, b.residency) == ("host", "host")
            assert eng.pager.host.pool.num_used == blocks - shared
            assert eng.handle(api.Prefetch("a")) == "host" and a.residency == "device" and not a.busy  # a resume
            eng.check()
        for sid in ("a", "b"):
            replies[llm, sid, 1] = turn(eng, sid, "And a star?")
        if llm is small:
            assert a.seq.block_ids[:shared] == before[:shared] == b.seq.block_ids[:shared]
            assert all(eng.pool.ref_counts[i] == 2 for i in a.seq.block_ids[:shared])
            assert eng.pager.moves[(HOST, DEVICE)] == 2
            assert eng.pager.host.pool.num_used == 0
    assert all(replies[small, sid, k] == replies[big, sid, k] for sid in "ab" for k in (0, 1))


def test_prefetch_of_a_dropped_session_starts_its_rebuild(bundled_fp32, eviction):
    """With no tier to take it, an idle session keeps its tokens; a resume queues its rebuild at once."""
    llm = make_llm(bundled_fp32, num_blocks=200, eviction=eviction)  # tiers on, but neither host memory nor a disk
    eng = llm.engine
    assert eng.pager is None
    eng.open_session("a")
    turn(eng, "a", "Name a planet.")
    s = eng.sessions["a"]
    tokens = list(s.seq.token_ids)
    eng.placer.drop(s)
    assert s.residency == "dropped" and eng.session_stats("a").residency == "dropped"
    assert eng.handle(api.Prefetch("a")) == "dropped" and s.busy and list(s.pending[0].token_ids) == tokens
    llm.drain()
    assert s.seq.token_ids == tokens and s.residency == "device"
    eng.check()
