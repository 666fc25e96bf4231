"""Pins sampling: admitted ranges, greedy below the temperature floor, safe numbers, seeded reproducibility,
penalties against hand computations, min-p."""

import math

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamchat.model import sampling
from streamchat.model.sampling import SamplingParams, TokenHistory, adjust_logits, make_generator, sample
from streamchat.server import protocol

NAN, INF = float("nan"), float("inf")


def draw(logits, params):
    """Sample rows of `logits` (a nested list) with fresh generators for `params`."""
    return sample(torch.tensor(logits), params, [make_generator(p) for p in params])


def draw_seeded(row, params, num_seeds):
    """The token that each seed in range(num_seeds) samples from one row."""
    return [draw([row], [SamplingParams(*params, seed=s)])[0] for s in range(num_seeds)]


# -- validate() -----------------------------------------------------------------------------


ADMITTED = [
    SamplingParams(),
    SamplingParams(0, 1, 0, None),
    SamplingParams(2.0, 5e-324, 2**63 - 1, 2**63 - 1),
    SamplingParams(1e-300, 1.0, 1, -(2**63)),
    SamplingParams(-0.0, 0.5, 40, 0),
    SamplingParams(frequency_penalty=-2, presence_penalty=2.0),
    SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=10.0, min_p=1.0),
    SamplingParams(repetition_penalty=5e-324, min_p=0.0),
    SamplingParams(min_p=5e-324, frequency_penalty=-0.0),
]
REFUSED = [
    SamplingParams(temperature=NAN), SamplingParams(temperature=INF), SamplingParams(temperature=-1e-300),
    SamplingParams(temperature=2.0000001), SamplingParams(temperature=True), SamplingParams(temperature="1"),
    SamplingParams(top_p=0.0), SamplingParams(top_p=NAN), SamplingParams(top_p=1.0000001),
    SamplingParams(top_k=-1), SamplingParams(top_k=1.0), SamplingParams(top_k=True), SamplingParams(top_k=2**63),
    SamplingParams(seed=2**63), SamplingParams(seed=-(2**63) - 1), SamplingParams(seed=1.0),
    SamplingParams(seed=False),
    SamplingParams(frequency_penalty=2.0000001), SamplingParams(frequency_penalty=-2.0000001),
    SamplingParams(presence_penalty=NAN), SamplingParams(presence_penalty=INF), SamplingParams(presence_penalty=True),
    SamplingParams(repetition_penalty=0.0), SamplingParams(repetition_penalty=10.000001),
    SamplingParams(repetition_penalty=-1.0), SamplingParams(repetition_penalty="1.1"),
    SamplingParams(min_p=-1e-300), SamplingParams(min_p=1.0000001), SamplingParams(min_p=NAN),
    SamplingParams(min_p=None),
]


@pytest.mark.parametrize("params", ADMITTED, ids=range(len(ADMITTED)))
def test_validate_admits_the_documented_bounds(params):
    """Each bound of each range is admitted and validate returns the same object."""
    assert params.validate() is params


@pytest.mark.parametrize("params", REFUSED, ids=range(len(REFUSED)))
def test_validate_refuses_outside_the_ranges(params):
    """NaN, infinities, bools, wrong types and values one step outside are ValueError."""
    with pytest.raises(ValueError):
        params.validate()


WIRE_REFUSED = [("temperature", -1e-300), ("temperature", 2.0000001), ("temperature", True), ("temperature", "1"),
                ("top_p", 0.0), ("top_k", -1), ("top_k", 1.0), ("top_k", 2**63), ("seed", 2**63), ("seed", 1.0),
                ("seed", False), ("frequency_penalty", 2.0000001), ("repetition_penalty", 0.0),
                ("repetition_penalty", "1.1"), ("min_p", 1.0000001)]


@pytest.mark.parametrize(("name", "value"), WIRE_REFUSED, ids=range(len(WIRE_REFUSED)))
def test_the_websocket_refuses_what_validate_refuses_in_the_same_words(name, value):
    """The wires read the sampling fields with validate's own table (no copy of the ranges to drift)."""
    with pytest.raises(ValueError) as refused:
        SamplingParams(**{name: value}).validate()
    frame = orjson.dumps({"type": "response.create", "response": {name: value}}).decode()
    with pytest.raises(protocol.ProtocolError) as on_websocket:
        protocol.parse_client_event(frame, limits=protocol.Limits())
    assert on_websocket.value.message == f"response.{refused.value}"


def test_seed_bounds_and_the_32_bit_generator():
    """Both int64 bounds seed a generator, which keeps the low 32 bits: seeds equal mod 2^32 match."""
    def stream(seed):
        return torch.rand(4, generator=make_generator(SamplingParams(seed=seed))).tolist()

    assert stream(-(2**63)) == stream(0) and stream(2**63 - 1) == stream(-1) == stream(2**32 - 1)
    assert stream(2**32 + 5) == stream(5) != stream(6)
    assert make_generator(SamplingParams()) is None


# -- temperature ----------------------------------------------------------------------------


def test_temperature_below_floor_is_exact_argmax():
    """1e-300 (the crash), subnormals and just under 1e-4 all return argmax and leave the generator alone."""
    row = [0.0, 3.0, 2.999, -1e30]
    for t in (1e-300, 5e-324, -0.0, math.nextafter(sampling.TEMPERATURE_FLOOR, 0)):
        params = SamplingParams(t, seed=1)
        gen = make_generator(params)
        state = gen.get_state()
        assert sample(torch.tensor([row]), [params], [gen]) == [1]
        assert torch.equal(gen.get_state(), state)


def test_temperature_at_floor_still_samples_a_tie():
    """At the floor exactly, a two-way tie is sampled: both tokens come up over ten seeds."""
    assert set(draw_seeded([5.0, 5.0, -1.0], (sampling.TEMPERATURE_FLOOR,), 10)) == {0, 1}


@pytest.mark.parametrize("temperature", [sampling.TEMPERATURE_FLOOR, 0.5, 2.0])
def test_extreme_logits_sample_the_dominant_token(temperature):
    """Logits of +-1e30 and float32's extremes, whose differences overflow, pick the dominant token."""
    rows = [[1e30, -1e30, 0.0], [-3.4e38, 0.0, 3.4e38], [-1e30, 1e30, -INF]]
    params = [SamplingParams(temperature, seed=i) for i in range(3)]
    assert draw(rows, params) == [0, 2, 1]


def test_temperature_scales_the_distribution():
    """Over 2,000 seeded draws, T=1 follows softmax(0, ln 1/4) and T=2 flattens it."""
    row = [0.0, math.log(0.25)]  # probabilities 0.8, 0.2 at T=1; 2/3, 1/3 at T=2
    gen = make_generator(SamplingParams(seed=0))
    ones = {t: sum(sample(torch.tensor([row]), [SamplingParams(t, seed=0)], [gen])[0] for _ in range(2000))
            for t in (1.0, 2.0)}
    assert 346 <= ones[1.0] <= 454 and 604 <= ones[2.0] <= 730  # +-3 sigma


# -- top-k and top-p ------------------------------------------------------------------------


def test_top_k_beyond_vocab_is_the_whole_vocab():
    """top_k of the vocab size, of 2^63-1, and 0 draw identical tokens for identical seeds."""
    row = [0.1, 0.2, 0.3, 0.4]
    runs = [draw_seeded(row, (1.0, 1.0, k), 40) for k in (0, 4, 2**63 - 1)]
    assert runs[0] == runs[1] == runs[2] and set(runs[0]) == {0, 1, 2, 3}


def test_top_k_keeps_the_k_most_likely():
    """top_k=2 only ever draws the two largest logits; top_k=1 is argmax."""
    row = [1.0, 3.0, 0.0, 2.0]
    assert set(draw_seeded(row, (2.0, 1.0, 2), 60)) == {1, 3}
    assert set(draw_seeded(row, (2.0, 1.0, 1), 20)) == {1}


def test_top_k_keeps_ties_with_the_kth():
    """Logits tied with the k-th stay in: top_k=1 over a three-way tie draws all three."""
    assert set(draw_seeded([2.0, 2.0, 2.0, -5.0], (1.0, 1.0, 1), 40)) == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    """Probabilities 0.5, 0.3, 0.2: top_p 0.75 keeps two tokens, 0.45 one, 0.85 all three."""
    row = [math.log(0.5), math.log(0.3), math.log(0.2)]
    assert set(draw_seeded(row, (1.0, 0.75), 80)) == {0, 1}
    assert set(draw_seeded(row, (1.0, 0.45), 40)) == {0}
    assert set(draw_seeded(row, (1.0, 0.85), 80)) == {0, 1, 2}


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-45, 1e-8])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """A top_p far below any probability still keeps the most likely token, so it is always drawn."""
    assert set(draw_seeded([0.0, 0.1, -0.1, 0.05], (2.0, top_p), 20)) == {1}


# -- corrupt logits -------------------------------------------------------------------------


def test_corrupt_rows_fall_back_to_greedy_over_finite_values():
    """NaN or +inf: argmax over finite values; nothing finite: token 0; -inf alone is a mask."""
    rows = [[NAN, 1.0, 2.0, NAN], [1.0, INF, 0.0, 3.0], [-INF, -INF, -INF, -INF],
            [NAN, NAN, NAN, NAN], [INF, -INF, NAN, INF]]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature, seed=3)] * len(rows)
        assert draw(rows, params) == [2, 3, 0, 0, 0]


def test_corrupt_row_leaves_its_generator_alone():
    """A corrupt row takes the greedy fallback without advancing its generator."""
    params = SamplingParams(1.0, seed=5)
    gen = make_generator(params)
    state = gen.get_state()
    assert sample(torch.tensor([[0.0, NAN, 1.0]]), [params], [gen]) == [2]
    assert torch.equal(gen.get_state(), state)


def test_minus_inf_masked_tokens_are_never_drawn():
    """A sampled row with -inf entries draws only among the others."""
    row = [-INF, 0.0, -INF, 0.0, -INF]
    assert set(draw_seeded(row, (2.0,), 40)) == {1, 3}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_logit_dtypes(dtype):
    """Half, bfloat16 and double logits are sampled like float32 ones."""
    logits = torch.tensor([[0.0, 9.0, -INF], [NAN, 1.0, 0.0]], dtype=dtype)
    params = [SamplingParams(1.0, top_k=1, seed=0), SamplingParams(1.0)]
    assert sample(logits, params, [make_generator(p) for p in params]) == [1, 1]


# -- seeds and batching ---------------------------------------------------------------------


def test_same_seed_same_logits_same_tokens():
    """Two generators from one seed draw the same 30 tokens; another seed draws other ones."""
    logits = torch.linspace(-2, 2, 50)[None]
    runs = []
    for seed in (11, 11, 12):
        params = SamplingParams(1.5, 0.95, 30, seed)
        gen = make_generator(params)
        runs.append([sample(logits, [params], [gen])[0] for _ in range(30)])
    assert runs[0] == runs[1] != runs[2]


def test_seeded_row_ignores_its_batch():
    """A seeded row draws the same token alone as in a batch with greedy, corrupt and other sampled rows."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    logits[2, 7] = NAN
    params = [SamplingParams(0.0), SamplingParams(0.8, 0.9, 0, 3), SamplingParams(1.0, seed=4),
              SamplingParams(1.2, 1.0, 20), SamplingParams(2.0, 0.3, 5, 9), SamplingParams(1.0, seed=10)]
    for _ in range(5):
        batch = sample(logits, params, [make_generator(p) for p in params])
        alone = [sample(logits[i:i + 1], [p], [make_generator(p)])[0] for i, p in enumerate(params)]
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        assert [batch[i] for i in seeded] == [alone[i] for i in seeded]
        assert batch[0] == int(logits[0].argmax()) and batch[2] == int(logits[2].nan_to_num(-INF).argmax())


def test_empty_batch():
    """No rows, no tokens."""
    assert sample(torch.empty(0, 8), [], []) == []


# -- penalties ------------------------------------------------------------------------------


def penalized(logits, params, recent=(), generated=()):
    """adjust_logits on one row, as a list."""
    return adjust_logits(torch.tensor([logits]), [params], [TokenHistory(recent, generated)])[0].tolist()


def test_frequency_and_presence_by_hand():
    """logit -= 0.5 * count + 0.25 * (count > 0), counts over the generated tokens only."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = penalized([1.0, 2.0, 0.5, -1.0, 0.0], params, recent=[2, 2, 4], generated=[1, 1, 3])
    assert got == [1.0, 2.0 - 1.0 - 0.25, 0.5, -1.0 - 0.5 - 0.25, 0.0]


def test_negative_frequency_and_presence_raise_seen_tokens():
    """Negative penalties (down to -2) favour the tokens already generated."""
    got = penalized([0.0, 0.0, 0.0], SamplingParams(frequency_penalty=-2.0, presence_penalty=-1.0), generated=[2, 2])
    assert got == [0.0, 0.0, 5.0]


def test_repetition_penalty_by_hand():
    """Seen once or thrice alike: a positive logit is divided by r, a negative one multiplied, 0 stays."""
    params = SamplingParams(repetition_penalty=2.0)
    got = penalized([2.0, -1.0, 0.5, 3.0, 0.0], params, recent=[0, 1, 1, 1, 4], generated=[3])
    assert got == [1.0, -2.0, 0.5, 3.0, 0.0]  # token 3 is only in `generated`: not in `recent`, not penalized


def test_repetition_penalty_looks_at_the_last_64_tokens():
    """A token seen only 65 tokens back is not penalized; one seen 64 back is."""
    recent = [0, 1] + [2] * 63  # 65 tokens: token 0 falls out of the window, token 1 is its first
    assert sampling.REPETITION_WINDOW == 64
    assert penalized([4.0, 4.0, 4.0], SamplingParams(repetition_penalty=4.0), recent=recent) == [4.0, 1.0, 1.0]


def test_repetition_then_frequency_and_presence():
    """All three on one token: (4 / 2) - 1 * 2 - 0.5 = -0.5."""
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0)
    assert penalized([4.0, 1.0], params, recent=[0], generated=[0, 0]) == [-0.5, 1.0]


def test_penalties_keep_finite_logits_finite_and_masks_masked():
    """x * 10 past float32 clamps to its minimum, x / 5e-324 to its maximum; -inf stays -inf."""
    big = torch.finfo(torch.float32).max
    got = penalized([-3.4e38, -INF, 5.0], SamplingParams(repetition_penalty=10.0), recent=[0, 1, 2])
    assert got == [-big, -INF, 0.5]
    assert penalized([1.0, 2.0], SamplingParams(repetition_penalty=5e-324), recent=[0]) == [big, 2.0]


def test_history_ids_outside_the_vocab_are_ignored():
    """Negative or too-large ids in a history count for nothing and raise nothing."""
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    assert penalized([1.0, 1.0], params, recent=[-1, 2, 99], generated=[-5, 7]) == [1.0, 1.0]


def test_penalties_change_the_greedy_token():
    """Greedy stays greedy with penalties: argmax of the penalized logits."""
    row = [3.0, 2.5, 0.0]
    history = [TokenHistory([0], [0])]
    assert draw([row], [SamplingParams(presence_penalty=1.0)]) == [0]  # no history: plain argmax
    assert sample(torch.tensor([row]), [SamplingParams(presence_penalty=1.0)], [None], history) == [1]
    assert sample(torch.tensor([row]), [SamplingParams(repetition_penalty=1.5)], [None], history) == [1]
    assert sample(torch.tensor([row]), [SamplingParams()], [None], history) == [0]  # unpenalized ignores history


def test_greedy_without_penalties_is_exactly_argmax():
    """Temperature 0 and no penalties: argmax of each row, with or without a history, in every dtype."""
    torch.manual_seed(1)
    logits = torch.randn(5, 1000)
    history = [TokenHistory(list(range(50)), list(range(20)))] * 5
    expected = logits.argmax(dim=-1).tolist()
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = logits.to(dtype)
        assert sample(x, [SamplingParams()] * 5, [None] * 5, history) == x.float().argmax(dim=-1).tolist()
    assert sample(logits, [SamplingParams()] * 5, [None] * 5) == expected


def test_history_none_leaves_penalties_without_effect():
    """Penalized params without a history draw what the same params without penalties draw."""
    torch.manual_seed(2)
    logits = torch.randn(3, 200)
    plain = [SamplingParams(1.0, 0.9, 0, s) for s in (1, 2, 3)]
    heavy = [SamplingParams(1.0, 0.9, 0, s, 2.0, 2.0, 10.0) for s in (1, 2, 3)]
    assert sample(logits, heavy, [make_generator(p) for p in heavy]) == \
        sample(logits, plain, [make_generator(p) for p in plain])


def test_sample_does_not_change_the_logits():
    """Penalties work on a copy: the caller's float32 logits are untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5], [1.0, 1.0, 1.0]])
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)] * 2
    sample(logits, params, [None, None], [TokenHistory([0, 1], [2])] * 2)
    assert torch.equal(logits, before)


def test_batched_penalties_equal_single_rows():
    """adjust_logits over rows at once equals row by row, exactly."""
    torch.manual_seed(3)
    logits = torch.randn(4, 300) * 4
    params = [SamplingParams(frequency_penalty=0.7), SamplingParams(presence_penalty=-0.4, repetition_penalty=1.3),
              SamplingParams(repetition_penalty=0.8), SamplingParams(1.0, 1.0, 0, None, 2.0, 2.0, 10.0)]
    history = [TokenHistory(torch.randint(0, 300, (n,)).tolist(), torch.randint(0, 300, (m,)).tolist())
               for n, m in ((10, 0), (80, 5), (0, 40), (64, 64))]
    batch = adjust_logits(logits, params, history)
    for i in range(4):
        assert torch.equal(batch[i:i + 1], adjust_logits(logits[i:i + 1], params[i:i + 1], history[i:i + 1]))


def test_penalized_seeded_rows_ignore_their_batch():
    """Seeded and greedy rows with penalties draw the same tokens alone as in a mixed batch."""
    torch.manual_seed(4)
    logits = torch.randn(5, 300) * 3
    logits[3, 9] = NAN
    params = [SamplingParams(0.0, repetition_penalty=1.5), SamplingParams(0.8, 0.9, 0, 3, 0.5, 0.5, 1.2, 0.05),
              SamplingParams(1.0), SamplingParams(1.0, seed=4, frequency_penalty=1.0),
              SamplingParams(1.5, 1.0, 50, 7, -1.0, 0.0, 1.0, 0.1)]
    history = [TokenHistory(torch.randint(0, 300, (70,)).tolist(), torch.randint(0, 300, (30,)).tolist())
               for _ in params]
    for _ in range(5):
        batch = sample(logits, params, [make_generator(p) for p in params], history)
        alone = [sample(logits[i:i + 1], [p], [make_generator(p)], history[i:i + 1])[0] for i, p in enumerate(params)]
        assert [batch[i] for i in (0, 1, 3, 4)] == [alone[i] for i in (0, 1, 3, 4)]
    assert batch[3] == int(logits[3].nan_to_num(-INF).argmax())  # corrupt: greedy, no penalties


# -- min-p ----------------------------------------------------------------------------------


def test_min_p_keeps_tokens_within_a_share_of_the_most_likely():
    """Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps three, 0.5 two, 0.7 one, 0 all four."""
    row = [math.log(q) for q in (0.5, 0.3, 0.15, 0.05)]
    for min_p, kept, seeds in ((0.25, {0, 1, 2}, 80), (0.5, {0, 1}, 60), (0.7, {0}, 20), (0.0, {0, 1, 2, 3}, 200)):
        got = {draw([row], [SamplingParams(1.0, min_p=min_p, seed=s)])[0] for s in range(seeds)}
        assert got == kept, min_p


def test_min_p_applies_after_the_temperature():
    """At T=2 the probabilities flatten to ~ sqrt: ratios 1, 0.77, 0.55, 0.32; min_p 0.5 keeps three."""
    row = [math.log(q) for q in (0.5, 0.3, 0.15, 0.05)]
    assert {draw([row], [SamplingParams(2.0, min_p=0.5, seed=s)])[0] for s in range(80)} == {0, 1, 2}


def test_min_p_one_keeps_the_most_likely_and_its_ties():
    """min_p 1 is argmax in effect; exact ties with the maximum stay."""
    assert {draw([[1.0, 3.0, 3.0, 2.9]], [SamplingParams(1.0, min_p=1.0, seed=s)])[0] for s in range(30)} == {1, 2}


# -- property: never raises, always in range ------------------------------------------------

temperatures = st.sampled_from([0.0, 5e-324, 1e-300, 9.999e-5, 1e-4, 2.0]) | st.floats(0.0, 2.0)
top_ps = st.sampled_from([5e-324, 1e-300, 1e-45, 1.0]) | st.floats(0.0, 1.0, exclude_min=True)
top_ks = st.sampled_from([0, 1, 2**63 - 1]) | st.integers(0, 40)
seeds = st.none() | st.integers(-(2**63), 2**63 - 1)
penalties = st.sampled_from([-2.0, 0.0, 2.0]) | st.floats(-2.0, 2.0)
repetition_penalties = st.sampled_from([5e-324, 1.0, 10.0]) | st.floats(0.0, 10.0, exclude_min=True)
min_ps = st.sampled_from([0.0, 5e-324, 1.0]) | st.floats(0.0, 1.0)
admitted = st.builds(SamplingParams, temperatures, top_ps, top_ks, seeds, penalties, penalties,
                     repetition_penalties, min_ps)
token_ids = st.lists(st.integers(-2, 40), max_size=80)
logit_values = st.sampled_from([NAN, INF, -INF, 1e30, -1e30, 3.4e38, -3.4e38, 0.0]) | \
    st.floats(-1e4, 1e4, width=32)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 33).flatmap(lambda vocab: st.lists(
    st.tuples(admitted, st.lists(logit_values, min_size=vocab, max_size=vocab), token_ids, token_ids),
    min_size=1, max_size=5)), st.booleans())
def test_sample_never_raises_and_stays_in_vocab(rows, with_history):
    """For admitted params, any logits (extremes, -inf masks, NaN, +inf) and any history, sample
    returns ints in [0, vocab)."""
    params = [p.validate() for p, *_ in rows]
    logits = torch.tensor([values for _, values, _, _ in rows], dtype=torch.float32)
    history = [TokenHistory(recent, generated) for *_, recent, generated in rows] if with_history else None
    tokens = sample(logits, params, [make_generator(p) for p in params], history)
    vocab = logits.shape[1]
    assert len(tokens) == len(rows) and all(type(t) is int and 0 <= t < vocab for t in tokens)
    for token, row in zip(tokens, logits):
        if bool((row == -INF).any()) and bool(torch.isfinite(row).any()):
            assert row[token] != -INF  # a mask is honoured whenever a finite value exists
