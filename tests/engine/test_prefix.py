"""Tests for shared prefix blocks through the engine, on the bundled model."""

import pytest

from streamchat.config import CacheConfig, Config, ModelConfig
from streamchat.llm import LLM

SYSTEM = ("You are a careful assistant for a shipping company. Answer questions about parcels, "
          "delivery times and customs rules. Be brief and polite, and never invent tracking numbers. ") * 3


def make(loaded, sharing=True, num_blocks=600):
    return LLM(Config(model=ModelConfig(dtype="float32"),
                      cache=CacheConfig(num_blocks=num_blocks, prefix_sharing=sharing)), loaded=loaded)


def test_shared_system_prompt_gives_the_same_greedy_reply_as_cold(bundled_fp32):
    """A session whose system prompt comes from shared blocks answers exactly as one computed cold."""
    cold = make(bundled_fp32, sharing=False).chat(["How long does a parcel to Spain take?"], 32, SYSTEM)[0]
    llm = make(bundled_fp32)
    first = llm.chat(["Hello!"], 8, SYSTEM)[0]
    warm = llm.chat(["How long does a parcel to Spain take?"], 32, SYSTEM)[0]
    assert first.usage.cached_tokens == 0
    prompt_blocks = len(llm.engine.chat.message("system", SYSTEM)) // 16
    assert warm.usage.cached_tokens >= prompt_blocks * 16
    assert warm.token_ids == cold.token_ids


def test_n_sessions_hold_the_system_prompt_once(bundled_fp32):
    """After 6 sessions with one system prompt, its full blocks exist once with ref count 6."""
    llm = make(bundled_fp32)
    eng = llm.engine
    system_len = len(eng.chat.bos_ids + eng.chat.message("system", SYSTEM))
    full = system_len // 16
    for i in range(6):
        eng.open_session(f"s{i}", SYSTEM)
        eng.add_item(f"s{i}", "user", f"Question number {i}?")
    llm.drain()
    eng.check()
    tables = [eng.sessions[f"s{i}"].seq.block_ids for i in range(6)]
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables)
    assert [eng.pool.ref_counts[b] for b in shared] == [6] * full
    own = {b for t in tables for b in t[full:]}
    assert len(own) == sum(len(t) - full for t in tables), "no block beyond the prompt is shared"
    assert eng.pool.num_used == full + len(own)
    stats = eng.session_stats("s3")
    assert stats.shared_blocks == full and stats.prefix_hit_tokens == full * 16
    assert eng.manager.num_prefix_hit_tokens == 5 * full * 16


@pytest.mark.parametrize("eviction", ["sink_window", "h2o"])
def test_sessions_share_their_pinned_prompt_and_evict_only_their_own_blocks(bundled_fp32, eviction):
    """Past the window, each session evicts its own blocks (either policy); the shared, pinned prompt stays."""
    llm = LLM(Config(model=ModelConfig(dtype="float32"),
                     cache=CacheConfig(num_blocks=200, window_tokens=64, eviction=eviction,
                                       h2o_recent_tokens=16)), loaded=bundled_fp32)
    eng = llm.engine
    system_len = len(eng.chat.bos_ids + eng.chat.message("system", SYSTEM))
    pinned_blocks = -(-system_len // 16)
    for i in range(3):  # sessions arrive one after another
        eng.open_session(f"s{i}", SYSTEM)
        for turn in range(4):
            eng.add_item(f"s{i}", "user", f"Session {i} says turn {turn}: " + "many words here " * 10)
        llm.drain()
    eng.check()
    for i in range(3):
        seq = eng.sessions[f"s{i}"].seq
        assert seq.evicted_tokens > 0
        assert len(seq.block_ids) <= pinned_blocks + 64 // 16 + 1
        assert seq.token_ids[:system_len] == eng.chat.bos_ids + eng.chat.message("system", SYSTEM)
    full = system_len // 16
    heads = [eng.sessions[f"s{i}"].seq.block_ids[:full] for i in range(3)]
    assert heads[0] == heads[1] == heads[2]
    assert [eng.pool.ref_counts[b] for b in heads[0]] == [3] * full
