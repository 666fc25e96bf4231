"""The scheduler alone (torch-free): how much prefill a step takes while sessions stream."""

from hypothesis import given
from hypothesis import strategies as st

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import SchedulerConfig
from streamchat.engine.costs import StepCosts
from streamchat.engine.scheduler import Scheduler
from streamchat.engine.session import EngineSession, Pending, Phase, Response


@given(st.floats(0, 10), st.integers(0, 100_000))
def test_tokens_within_is_the_largest_chunk_that_fits(seconds, context):
    """tokens_within(s, c) is the largest n whose marginal cost n*t + n*(c+n)*p fits s."""
    costs = StepCosts()
    n = costs.tokens_within(seconds, context)

    def cost(k):
        return costs.per_token * k + costs.per_pair * k * (context + k)
    assert cost(n) <= seconds * (1 + 1e-9)
    assert cost(n + 1) > seconds * (1 - 1e-9)


def test_the_cost_model_learns_a_machine_from_its_steps():
    """Steps timed by a known linear law: the fit recovers it closely, whatever the priors said."""
    costs = StepCosts()
    law = (0.004, 0.0011, 2e-6)
    shapes = [(16, 32_000), (1, 2_000), (256, 66_000), (64, 140_000), (17, 300_000), (200, 5_000)] * 10
    for tokens, pairs in shapes:
        costs.observe(tokens, pairs, law[0] + law[1] * tokens + law[2] * pairs)
    for tokens, pairs in ((32, 64_000), (128, 10_000)):
        truth = law[0] + law[1] * tokens + law[2] * pairs
        assert abs(costs.estimate(tokens, pairs) - truth) < 0.05 * truth


def streaming_cfg(target_ms: float = 200.0, share: float = 0.25) -> SchedulerConfig:
    return SchedulerConfig(max_tokens_per_step=256, target_step_ms=target_ms, min_prefill_share=share)


def make(cfg: SchedulerConfig, window=2048, blocks=1024):
    manager = KVCacheManager(BlockPool(blocks), 16, 4, window)
    return Scheduler(cfg, manager), manager


def streaming(manager, sid="a") -> EngineSession:
    s = EngineSession(sid, manager.new_seq())
    manager.append(s.seq, list(range(1, 40)))
    s.response = Response("r", None, None, None, 0.0, phase=Phase.DECODE, next_token=7)
    return s


def appending(manager, cached: int, pending: int, sid="b") -> EngineSession:
    s = EngineSession(sid, manager.new_seq())
    for start in range(0, cached, 512):
        manager.append(s.seq, [5] * min(512, cached - start))
    s.pending.append(Pending([6] * pending))
    return s


def fixed_costs(sched, fixed=0.01, per_token=0.002, per_pair=1e-6):
    sched.costs.fixed, sched.costs.per_token, sched.costs.per_pair = fixed, per_token, per_pair


def test_prefill_fills_the_step_to_its_time_target_while_streaming():
    """One stream (~0.05 s by the model) and a long append: the chunk takes the rest of 200 ms."""
    sched, manager = make(streaming_cfg())
    fixed_costs(sched)
    a, b = streaming(manager), appending(manager, cached=2048, pending=10_000)
    out = sched.schedule([a, b])
    [decode], [chunk] = out.batch.decode, out.batch.prefill
    n = len(chunk.token_ids)
    decode_s = sched.costs.estimate(1, 40)
    assert decode.token_ids == [7]
    assert n == sched.costs.tokens_within(0.2 - decode_s, 2048) == 45
    assert sched.costs.estimate(1 + n, 40 + n * chunk.seq_len) <= 0.2 + 1e-9


def test_prefill_keeps_a_share_when_decode_alone_passes_the_target():
    """Decode estimated past the target: prefill still gets min_prefill_share of the decode time."""
    sched, manager = make(streaming_cfg(target_ms=10.0, share=0.5))
    fixed_costs(sched, per_token=0.0002)  # decode ~10.2 ms: past the target
    a, b = streaming(manager), appending(manager, cached=0, pending=1000)
    out = sched.schedule([a, b])
    decode_s = sched.costs.estimate(1, 40)
    assert len(out.batch.prefill[0].token_ids) == sched.costs.tokens_within(0.5 * decode_s, 0) > 0


def test_no_stream_means_the_whole_step_budget():
    sched, manager = make(SchedulerConfig(max_tokens_per_step=256))
    b = appending(manager, cached=2048, pending=10_000)
    out = sched.schedule([b])
    assert len(out.batch.prefill[0].token_ids) == 256


def test_prefill_time_is_shared_fairly_and_the_turn_moves_on():
    """Four long appends beside a stream share the step; the next step starts after the last served."""
    sched, manager = make(streaming_cfg(target_ms=400.0))
    fixed_costs(sched)
    a = streaming(manager)
    others = [appending(manager, 512, 1000, sid) for sid in "bcde"]
    first = sched.schedule([a, *others])
    sizes = [len(ch.token_ids) for ch in first.batch.prefill]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 2  # equal shares of the same context
    a.response.next_token = 8
    few = sched.schedule([a, *others])  # contexts grew: still every one served, in turn
    assert {o.session_id for o in few.owners[1:]} == set("bcde")


def test_a_chunk_never_shrinks_below_a_block():
    """A share worth less than one block still moves a whole block: tiny chunks waste a pass."""
    sched, manager = make(streaming_cfg(target_ms=1.0, share=0.0))
    fixed_costs(sched)
    a, b = streaming(manager), appending(manager, cached=2048, pending=100)
    out = sched.schedule([a, b])
    assert [len(ch.token_ids) for ch in out.batch.prefill] == [16]


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
