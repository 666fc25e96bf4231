"""The seeded draw used off the CPU: one uniform from the row's CPU generator, the rest on the logits' device."""

import torch

from streamchat.model.sampling import SamplingParams, draw_inverse, make_generator


def test_inverse_draw_follows_the_probabilities_and_skips_zero_ones():
    """Over 4,000 draws from (0, 0.25, 0, 0.75, 0): only tokens 1 and 3, in proportion within 3%."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    gen = make_generator(SamplingParams(1.0, seed=0))
    drawn = [draw_inverse(probs, gen) for _ in range(4000)]
    assert set(drawn) == {1, 3}
    assert abs(drawn.count(1) / 4000 - 0.25) < 0.03


def test_inverse_draw_is_reproducible_per_seed():
    """The same seed draws the same tokens; a row of one certain token always gives it."""
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(3)), 0)
    runs = [[draw_inverse(probs, gen) for _ in range(20)]
            for gen in (make_generator(SamplingParams(1.0, seed=9)) for _ in range(2))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 3
    one_hot = torch.zeros(7)
    one_hot[6] = 1.0
    gen = make_generator(SamplingParams(1.0, seed=1))
    assert {draw_inverse(one_hot, gen) for _ in range(50)} == {6}
