"""Pins the fast draw against the sampler it replaced: the same kept set and probabilities, from candidates
or from the full sort, and draws that follow them."""

import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from streamchat.model import sampling_draw
from streamchat.model.sampling import SamplingParams
from streamchat.model.sampling_draw import kept_candidates

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402  bench/common.py: the benchmark's logits

INF = float("inf")


# -- the oracle: the sampler before the fast path, frozen -------------------------------------


def reference_kept(x, params):
    """(S, vocab) float32 logits -> scaled logits with what min_p, top-k and top-p drop set to -inf.

    The previous implementation, kept verbatim: shift by the max, divide by
    the temperature, min_p, then a stable sort of the row for top-k and top-p.
    """
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
    x = x.masked_fill(x < floor[:, None], float("-inf"))
    vocab = x.shape[-1]
    k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params])
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params])
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None].float()
    drop[:, 0] = False
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))


def top_p_is_ambiguous(x, params, margin=1e-5):
    """Whether some prefix's mass lies within `margin` of top_p: there float32 and float64 may cut apart."""
    if params.top_p >= 1.0:
        return False
    before_top_p = reference_kept(x[None], [SamplingParams(params.temperature, top_k=params.top_k,
                                                           min_p=params.min_p)])[0]
    probs = torch.softmax(before_top_p.double(), dim=-1).sort(descending=True).values
    mass_before = probs.cumsum(0) - probs
    return bool(((mass_before - params.top_p).abs() <= margin).any())


def assert_same_kept(kept, reference_row):
    """A Kept equals the oracle's row: the same ids kept (with any weight) and the same probabilities."""
    ids = [i for i, v in zip(kept.ids, kept.values) if v > -INF]
    assert sorted(ids) == torch.nonzero(reference_row > -INF)[:, 0].tolist()
    weights = torch.tensor(kept.values, dtype=torch.float64).exp()
    probs = torch.zeros(reference_row.shape[0], dtype=torch.float64)
    probs[kept.ids] = weights / weights.sum()
    torch.testing.assert_close(probs, torch.softmax(reference_row.double(), dim=-1), atol=1e-6, rtol=1e-5)


def model_like(rows, vocab=49152, seed=0):
    """Logits shaped like a small language model's, as bench/sampling.py times the sampler on."""
    return common.model_like_logits(rows, vocab, seed)


# -- candidates against the oracle ------------------------------------------------------------

sampled_params = st.builds(
    SamplingParams,
    st.sampled_from([1e-4, 0.3, 0.7, 1.0, 2.0]) | st.floats(1e-4, 2.0),
    st.sampled_from([1.0, 0.9, 0.5, 1e-8]) | st.floats(0.0, 1.0, exclude_min=True),
    st.sampled_from([0, 1, 2, 3, 5]) | st.integers(0, 12),
    st.none(), st.just(0.0), st.just(0.0), st.just(1.0),
    st.sampled_from([0.0, 0.05, 0.5, 1.0]) | st.floats(0.0, 1.0))
PALETTE = torch.tensor([0.0, 1.0, -1.0, 2.5, -INF, 30.0, -30.0, 2.5 + 2**-21])


def random_logits(num_rows, vocab, seed, tie_share):
    """Seeded logits where a share `tie_share` of entries come from a palette (ties, -inf, extremes)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen) * 4
    from_palette = torch.rand(num_rows, vocab, generator=gen) < tie_share
    picks = PALETTE[torch.randint(0, len(PALETTE), (num_rows, vocab), generator=gen)]
    return torch.where(from_palette, picks, x)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sampled_params, min_size=1, max_size=4), st.sampled_from([3, 7, 20, 64 * 6, 64 * 9]),
       st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.3, 0.9, 1.0]), st.sampled_from([1, 2, 4, 5]))
def test_candidates_keep_what_the_full_sort_keeps(params, vocab, seed, tie_share, width):
    """Whatever the logits (ties, -inf, extremes) and params, a row the candidates settle keeps the oracle's
    ids with the oracle's probabilities; a few candidates and vocabs of 64-wide blocks exercise both paths."""
    x = random_logits(len(params), vocab, seed, tie_share)
    assume(bool(torch.isfinite(x.amax(dim=-1)).all()))
    with mock.patch.object(sampling_draw, "CANDIDATES", width), mock.patch.object(sampling_draw, "MAX_CANDIDATES", 6):
        kept = kept_candidates(x, params)
    reference = reference_kept(x, params)
    for i, row_kept in enumerate(kept):
        if row_kept is not None and not top_p_is_ambiguous(x[i], params[i]):
            assert_same_kept(row_kept, reference[i])


def test_model_like_rows_settle_among_the_candidates():
    """At the default params, every one of 32 model-like rows is settled by 128 candidates, as the oracle keeps."""
    x = model_like(32)
    params = [SamplingParams(0.7, 0.9)] * 32
    kept = kept_candidates(x, params)
    assert all(k is not None for k in kept)
    reference = reference_kept(x, params)
    for row_kept, reference_row in zip(kept, reference):
        assert_same_kept(row_kept, reference_row)


def test_wide_nucleus_and_wide_top_k_go_to_the_sort():
    """A flat row's nucleus (thousands of tokens) and a top_k past MAX_CANDIDATES cannot be settled."""
    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1))
    assert kept_candidates(x, [SamplingParams(0.7, 0.9), SamplingParams(1.0, top_k=5000)]) == [None, None]


def test_min_p_and_top_k_settle_without_a_full_pass():
    """min_p and a small top_k put the threshold above the bound: settled with the oracle's set."""
    x = model_like(4, seed=2)
    params = [SamplingParams(1.0, min_p=0.05), SamplingParams(0.7, top_k=40), SamplingParams(1.5, top_k=5, min_p=0.1),
              SamplingParams(0.7, 0.8, 50)]
    kept = kept_candidates(x, params)
    reference = reference_kept(x, params)
    assert [len(k.ids) for k in kept] == [int((r > -INF).sum()) for r in reference]
    assert len(kept[1].ids) == 40 and len(kept[2].ids) <= 5
    for row_kept, reference_row in zip(kept, reference):
        assert_same_kept(row_kept, reference_row)


def test_a_top_p_cut_inside_a_tie_keeps_the_lower_ids():
    """Eight tied logits scattered over 64-wide blocks, top_p 0.3: the three lowest ids stay, as the sort keeps."""
    x = torch.full((1, 64 * 40), -10.0)
    tied = [2000, 70, 1500, 5, 640, 2500, 1300, 9]
    x[0, tied] = 4.0
    kept = kept_candidates(x, [SamplingParams(1.0, 0.3)])[0]
    assert kept.ids == [5, 9, 70]
    assert reference_kept(x, [SamplingParams(1.0, 0.3)])[0].gt(-INF).nonzero()[:, 0].tolist() == [5, 9, 70]


def test_ties_past_the_candidates_fall_back():
    """top_k 2 over six tied logits and width 4: the k-th ties with logits outside, so the row goes to the sort."""
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0, 3.0, 3.0, 3.0, -1.0, 2.0]])
    with mock.patch.object(sampling_draw, "CANDIDATES", 4):
        assert kept_candidates(x, [SamplingParams(1.0, top_k=2)]) == [None]
        tokens = {sampling_draw.draw(x, [SamplingParams(1.0, top_k=2)], [u / 60])[0] for u in range(60)}
    assert tokens == {1, 2, 4, 5, 6, 7}


# -- the draw ---------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0.9), SamplingParams(0.7), SamplingParams(1.0, min_p=0.02),
                                    SamplingParams(1.3, 0.95, 20), SamplingParams(2.0, 0.5)],
                         ids=["default", "temperature", "min_p", "top_k+top_p", "hot"])
def test_draw_follows_the_reference_distribution(params):
    """1,000 evenly spread uniforms through `draw` give each token its oracle probability within 1/1,000."""
    x = model_like(1, vocab=64 * 130, seed=3)  # past 128 blocks: the candidates come from block maxima
    num_draws = 1000
    drawn = sampling_draw.draw(x.expand(num_draws, -1).contiguous(), [params] * num_draws,
                               [(j + 0.5) / num_draws for j in range(num_draws)])
    counts = torch.bincount(torch.tensor(drawn), minlength=x.shape[-1]).double() / num_draws
    probs = torch.softmax(reference_kept(x, [params])[0].double(), dim=-1)
    assert set(drawn) <= set(probs.nonzero()[:, 0].tolist())
    assert float((counts - probs).abs().max()) <= 1 / num_draws + 1e-9


def test_a_flat_row_draws_through_the_sort():
    """A nucleus of thousands: tokens only from the oracle's kept set, which holds most of the vocab."""
    x = torch.randn(1, 3000, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(1.0, 0.5)] * 300
    drawn = sampling_draw.draw(x.expand(300, -1).contiguous(), params, [(j + 0.5) / 300 for j in range(300)])
    kept = set(reference_kept(x, params[:1])[0].gt(-INF).nonzero()[:, 0].tolist())
    assert set(drawn) <= kept and len(kept) > 400 and len(set(drawn)) > 200


# -- the candidates themselves ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5, 1.0]))
def test_largest_bounds_every_logit_outside(width, seed, tie_share):
    """_largest returns `width` of the largest logits, descending, and every logit outside is <= its bound."""
    x = random_logits(1, 64 * 14, seed, tie_share)
    values, ids, bound = sampling_draw._largest(x, width)
    assert values.shape == (1, width) and torch.equal(x[0, ids[0]], values[0])
    assert values[0].tolist() == sorted(x[0].tolist(), reverse=True)[:width]
    outside = torch.ones(x.shape[-1], dtype=torch.bool)
    outside[ids[0]] = False
    assert bool((x[0, outside] <= bound[0, 0]).all())
