"""Tests of every cache feature on MLA sessions: position-free latent blocks under sinks + window, h2o,
prefix sharing, quantized latents, host and disk tiers with exact resume, and the stats' bytes."""

import math

import pytest
import torch
from deepseek_kit import feed, hf_model, one_thread, ours, save_folder  # noqa: F401 (one_thread: autouse)

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, Config, ModelConfig, SchedulerConfig, TierConfig
from streamchat.kernels import quant
from streamchat.evaluate import evaluate, read_text, tokenize
from streamchat.evaluate_policies import EvalSpec
from streamchat.llm import LLM
from streamchat.model.loader import resolve
from streamchat.model.runner import ModelRunner, load_model

V2_LATENT_BYTES = {"auto": 576 * 4, "int8": 576 + 2 * 4, "fp8": 576 + 2 * 4, "int4": 288 + 18 * 2 * 2}
V3_LATENT_BYTES = {"auto": 96 * 4, "int8": 96 + 2 * 4}  # the V3-style test model: kv_lora_rank 64, rope 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The V3-style model (two layers, a query low-rank projection) with the bundled tokenizer: the
    engine tests' many small steps run at half the cost of V2-Lite's 16 heads x 576."""
    return save_folder(hf_model("v3"), tmp_path_factory.mktemp("dsv3"), resolve(None).folder)


def make_llm(folder, num_blocks, eviction="sink_window", host_blocks=0, data_dir=None, window=32,
             kv_dtype="auto", prefix_sharing=True):
    per_block = 2 * V3_LATENT_BYTES[kv_dtype] * 16
    cfg = Config(model=ModelConfig(path=str(folder), dtype="float32", num_threads=1),
                 cache=CacheConfig(num_blocks=num_blocks, window_tokens=window, eviction=eviction,
                                   h2o_recent_tokens=window - 32, kv_dtype=kv_dtype, prefix_sharing=prefix_sharing),
                 scheduler=SchedulerConfig(max_tokens_per_step=128),
                 tiers=TierConfig(host_tier_gib=host_blocks * per_block / (1 << 30),
                                  disk_tier_gib=1.0 if data_dir else 0.0,
                                  data_dir=str(data_dir) if data_dir else None))
    llm = LLM(cfg, tiers=True)
    assert llm.runner.bytes_per_block == per_block
    return llm


def turn(llm, sid, text):
    """One user item and a greedy reply of up to 6 tokens; the engine's invariants checked after it."""
    llm.engine.add_item(sid, "user", text)
    reply = llm.respond([sid], max_tokens=6)[0].token_ids
    llm.engine.check()
    return reply


QUESTIONS = ["Name a planet.", "What colour is the sky?", "Say a word for happy.", "Count to three.",
             "Name a fruit."]
FOLLOW_UPS = ["And another one?", "Why is that?"]


def rounds(llm, num_sessions=5):
    """Every session takes a turn in turn, three rounds; the replies by round and session."""
    for i in range(num_sessions):
        llm.engine.open_session(f"s{i}", "You are terse." if i % 2 else "")
    return [[turn(llm, f"s{i}", QUESTIONS[i] if r == 0 else FOLLOW_UPS[r - 1]) for i in range(num_sessions)]
            for r in range(3)]


@pytest.mark.parametrize("eviction,kv_dtype", [("sink_window", "auto"), ("h2o", "int8")])
def test_tiny_pool_pages_mla_sessions_through_host_and_disk_exactly(folder, tmp_path, eviction, kv_dtype):
    """5 sessions past their window in a pool for 2 and a host tier for 1: all go down to host and disk
    and come back, every reply the same as with a pool where nothing pages out."""
    want = rounds(make_llm(folder, 200, eviction, kv_dtype=kv_dtype))
    llm = make_llm(folder, 9, eviction, host_blocks=5, data_dir=tmp_path, kv_dtype=kv_dtype)
    assert rounds(llm) == want
    eng = llm.engine
    moves = eng.pager.moves
    assert moves[("device", "host")] and moves[("host", "disk")] and moves[("host", "device")]
    assert moves[("disk", "device")] or moves[("device", "disk")]
    assert eng.scheduler.stats.idle_drops == 0 and eng.scheduler.stats.preemptions == 0
    assert eng.manager.evicted_by_policy[eviction] == eng.manager.num_evicted_tokens > 0
    if eviction == "h2o":  # attention mass per block reached every session's scores
        scores = [s.seq.block_scores if s.resident else s.parked.block_scores for s in eng.sessions.values()]
        assert all(any(x > 0 for x in sc) for sc in scores), scores


def test_sessions_share_a_system_prompt_s_latent_blocks(folder):
    """Two sessions with one system prompt: the second takes the first's latent blocks by prefix hash,
    and both reply as they do with prefix sharing off."""
    system = "You are a patient assistant. You answer every question in one short sentence, always."
    replies = {}
    for sharing in (True, False):
        llm = make_llm(folder, 64, window=256, prefix_sharing=sharing)
        eng = llm.engine
        for sid, question in (("a", "Name a river."), ("b", "Name a star.")):
            eng.open_session(sid, system)
            replies[sharing, sid] = turn(llm, sid, question)
        a, b = eng.sessions["a"], eng.sessions["b"]
        shared = a.pinned_tokens // 16  # the system prompt's full blocks
        assert shared >= 1
        assert (a.seq.block_ids[:shared] == b.seq.block_ids[:shared]) == sharing
        hits = eng.session_stats("b").prefix_hit_tokens
        assert hits >= shared * 16 if sharing else hits == 0
        assert eng.session_stats("a").kv_bytes == len(a.seq.block_ids) * 16 * 2 * V3_LATENT_BYTES["auto"]
    assert replies[True, "a"] == replies[False, "a"] and replies[True, "b"] == replies[False, "b"]


def test_latent_blocks_do_not_move_with_eviction_and_equal_a_fresh_prefill():
    """A block's latents are the same bytes before and after an eviction shifts it left in the table,
    and (layer 0, whose latents see only their own token) those a fresh prefill of the cache's tokens
    writes at that table index: the rotary part is stored by its offset in its block."""
    loaded = ours(hf_model("v3", vocab=300))
    gen = torch.Generator().manual_seed(3)
    runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=12))
    mgr = KVCacheManager(BlockPool(12), 16, sink_tokens=16, window_tokens=48)
    seq = mgr.new_seq()
    feed(runner, mgr, seq, torch.randint(0, 300, (64,), generator=gen).tolist())  # sink + full window
    before = {b: [kv.latent[b].clone() for kv in runner.kv_caches] for b in seq.block_ids}
    moved = seq.block_ids[2]
    feed(runner, mgr, seq, [7])  # needs a block: evicts table index 1, block `moved` goes 2 -> 1
    assert seq.evicted_tokens == 16 and seq.block_ids.index(moved) == 1
    for b in seq.block_ids[:-1]:
        assert all(torch.equal(kv.latent[b], x) for kv, x in zip(runner.kv_caches, before[b]))
    fresh_runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=12))
    fresh_mgr = KVCacheManager(BlockPool(12), 16, 16, 1 << 20)
    fresh = fresh_mgr.new_seq()
    feed(fresh_runner, fresh_mgr, fresh, list(seq.token_ids))  # the evicted cache's tokens at their new positions
    for idx, (b, fb) in enumerate(zip(seq.block_ids, fresh.block_ids)):
        used = min(16, len(seq.token_ids) - 16 * idx)
        torch.testing.assert_close(fresh_runner.kv_caches[0].latent[fb, :used], runner.kv_caches[0].latent[b, :used],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
def test_quantized_latents_are_the_float_latents_quantized(kv_dtype):
    """int8 / fp8 / int4 latents: the pool holds 576 stored values a token and layer plus scales;
    layer 0's stored rows are exactly the float pool's rows quantized (its latents see only their
    own token); the logits stay near the float pool's (a random model is sharp: these bounds are
    numerical fidelity, measured 0.014, 0.051 and 0.14 of the logits' spread)."""
    loaded = ours(hf_model("v2", vocab=300))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    logits, pools = {}, {}
    for name in ("auto", kv_dtype):
        runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=6, kv_dtype=name))
        pool_bytes = sum(t.nbytes for kv in runner.kv_caches for t in kv if t is not None)
        assert runner.bytes_per_token == 3 * V2_LATENT_BYTES[name] == pool_bytes // (6 * 16)
        mgr = KVCacheManager(BlockPool(6), 16, 4, 1 << 20)
        seq = mgr.new_seq()
        logits[name] = torch.cat([feed(runner, mgr, seq, ids[:24])] +
                                 [feed(runner, mgr, seq, [t], decode=True) for t in ids[24:]])
        pools[name] = [t[seq.block_ids].flatten(0, 1)[:len(ids)] for t in runner.kv_caches[0] if t is not None]
    (floats,), (stored, scales) = pools["auto"], pools[kv_dtype]
    want, want_scales = quant.quantize_latent(floats.float(), stored.dtype, 512)
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scales, want_scales)
    err = (logits[kv_dtype] - logits["auto"]).abs().mean() / logits["auto"].std()
    assert 0 < err < {"int8": 0.03, "fp8": 0.1, "int4": 0.25}[kv_dtype], err


def test_streamchat_eval_scores_an_mla_folder(folder):
    """`streamchat eval`'s evaluation on the MLA model: full, sink + window and h2o, float and int8
    latents, every token scored; evicting policies score differently from full once past the window."""
    loaded = load_model(ModelConfig(path=str(folder), dtype="float32", num_threads=1))
    ids = tokenize(loaded.tokenizer, read_text(None), 96)
    spec = EvalSpec(sink_tokens=4, window_tokens=32, block_size=16, h2o_recent_tokens=0)
    results = list(evaluate(loaded, ids, spec, ["full", "sink", "h2o"], ["auto", "int8"]))
    assert [(r.kv_dtype, r.policy) for r in results] == [(kv, p) for kv in ("auto", "int8")
                                                        for p in ("full", "sink", "h2o")]
    assert all(r.tokens == 95 and math.isfinite(r.nll) for r in results)
    assert results[0].nll != results[1].nll and results[0].nll != results[3].nll
