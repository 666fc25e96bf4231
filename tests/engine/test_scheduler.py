"""The scheduler alone (torch-free): how much prefill a step takes while sessions stream."""

from hypothesis import given
from hypothesis import strategies as st

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import SchedulerConfig
from streamchat.engine.scheduler import Scheduler
from streamchat.engine.session import EngineSession, Pending, Phase, Response


@given(st.integers(0, 100_000), st.integers(-1_000, 1_000_000), st.booleans())
def test_tokens_for_keys_is_the_largest_fitting_chunk(context, keys, first):
    n = Scheduler._tokens_for_keys(context, keys, first)
    if keys <= 0:  # spent by an earlier chunk of the step
        assert n == (1 if first else 0)
    elif n * (context + n) > keys:
        assert first and n == 1  # the step's first chunk always moves
    else:
        assert (n + 1) * (context + n + 1) > keys


def streaming_cfg(keys: int = 16384) -> SchedulerConfig:
    return SchedulerConfig(max_tokens_per_step=256, prefill_tokens_while_decoding=64,
                           prefill_keys_while_decoding=keys)


def make(cfg: SchedulerConfig, window=2048, blocks=1024):
    manager = KVCacheManager(BlockPool(blocks), 16, 4, window)
    return Scheduler(cfg, manager), manager


def streaming(manager, sid="a") -> EngineSession:
    s = EngineSession(sid, manager.new_seq())
    manager.append(s.seq, list(range(1, 40)))
    s.response = Response("r", None, None, None, None, 0.0, phase=Phase.DECODE, next_token=7)
    return s


def appending(manager, cached: int, pending: int, sid="b") -> EngineSession:
    s = EngineSession(sid, manager.new_seq())
    for start in range(0, cached, 512):
        manager.append(s.seq, [5] * min(512, cached - start))
    s.pending.append(Pending([6] * pending))
    return s


def test_long_context_chunk_is_bounded_by_attention_work_while_streaming():
    sched, manager = make(streaming_cfg())
    a, b = streaming(manager), appending(manager, cached=2048, pending=10_000)
    out = sched.schedule([a, b])
    [decode], [chunk] = out.batch.decode, out.batch.prefill
    n = len(chunk.token_ids)
    assert decode.token_ids == [7]
    assert n == Scheduler._tokens_for_keys(2048, 16384, True) == 7
    assert n * chunk.seq_len <= 16384


def test_short_prompt_gets_the_token_cap_while_streaming():
    sched, manager = make(streaming_cfg())
    a, c = streaming(manager), appending(manager, cached=0, pending=300, sid="c")
    out = sched.schedule([a, c])
    assert len(out.batch.prefill[0].token_ids) == 64  # 64 * 64 <= 16384: the token cap binds


def test_no_stream_means_the_whole_step_budget():
    cfg = SchedulerConfig(max_tokens_per_step=256, prefill_keys_while_decoding=16384)
    sched, manager = make(cfg)
    b = appending(manager, cached=2048, pending=10_000)
    out = sched.schedule([b])
    assert len(out.batch.prefill[0].token_ids) == 256


def test_attention_budget_is_shared_across_sessions_in_a_step():
    sched, manager = make(streaming_cfg())
    a = streaming(manager)
    b, c = appending(manager, 2048, 1000, "b"), appending(manager, 2048, 1000, "c")
    first = sched.schedule([a, b, c])
    work = sum(len(ch.token_ids) * ch.seq_len for ch in first.batch.prefill)
    assert len(first.batch.prefill) == 1 and work <= 16384  # the second long chunk does not fit
    second = sched.schedule([a, b, c])  # round-robin: the other one goes next
    assert len(second.batch.prefill) == 1
    assert {first.owners[-1].session_id, second.owners[-1].session_id} == {"b", "c"}


def test_a_session_in_this_step_is_never_the_victim_of_a_later_chunk():
    """X's last pending chunk makes it idle, but its blocks are written this step: Y must not take them."""
    sched, manager = make(SchedulerConfig(max_tokens_per_step=256), window=64, blocks=6)  # 5 usable
    x = appending(manager, cached=32, pending=16, sid="x")  # 3 blocks once its chunk is in
    y = appending(manager, cached=0, pending=48, sid="y")  # needs 3 more: only 2 are free
    out = sched.schedule([x, y])
    slots = [set(ch.slots) for ch in out.batch.prefill]
    assert out.owners[0] is x and not x.busy
    assert all(a.isdisjoint(b) for i, a in enumerate(slots) for b in slots[i + 1:])
    manager.check([x.seq, y.seq])


def test_a_forced_first_chunk_past_the_budget_leaves_none_for_the_others():
    """The first chunk always moves, even past the budget; then nobody else prefills this step."""
    sched, manager = make(streaming_cfg(keys=100))
    a = streaming(manager)
    b, c = appending(manager, 2048, 1000, "b"), appending(manager, 0, 50, "c")
    out = sched.schedule([a, b, c])
    assert [len(ch.token_ids) for ch in out.batch.prefill] == [1]
    assert a.response.next_token is None  # placed: the step samples the next one
    a.response.next_token = 8
    out = sched.schedule([a, b, c])  # round-robin: c first now, 10 tokens at no context use all 100
    assert [len(ch.token_ids) for ch in out.batch.prefill] == [10]
