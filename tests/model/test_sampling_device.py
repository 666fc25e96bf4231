"""The draw every sampled row takes, on any device: one uniform (a seeded row's from its CPU generator) through an
inverse CDF of the row's weights, computed where the logits are."""

import torch

from streamchat.model.sampling import SamplingParams, make_generator, sample
from streamchat.model.sampling_draw import inverse_cdf


def test_inverse_cdf_follows_the_weights_and_skips_zero_ones():
    """Over 4,000 uniforms on (0, 0.25, 0, 0.75, 0): only positions 1 and 3, in proportion within 3%."""
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(4000, -1)
    drawn = inverse_cdf(weights, torch.rand(4000, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(0))).tolist()
    assert set(drawn) == {1, 3}
    assert abs(drawn.count(1) / 4000 - 0.25) < 0.03


def test_inverse_cdf_at_the_ends_of_the_uniform_range():
    """u = 0 gives the first positive weight; u just under 1 the last one, never a trailing zero."""
    weights = torch.tensor([[0.0, 2.0, 1.0, 0.0]] * 2)
    assert inverse_cdf(weights, torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)).tolist() == [1, 2]


def test_seeded_draws_are_reproducible_per_seed():
    """The same seed draws the same tokens; a row of one possible token always gives it."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(1.0, seed=9)
    runs = [[sample(logits, [params], [gen])[0] for _ in range(20)] for gen in (make_generator(params),
                                                                                  make_generator(params))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 3
    one_hot = torch.full((1, 7), float("-inf"))
    one_hot[0, 6] = 0.0
    gen = make_generator(SamplingParams(1.0, seed=1))
    assert {sample(one_hot, [SamplingParams(1.0, seed=1)], [gen])[0] for _ in range(50)} == {6}
