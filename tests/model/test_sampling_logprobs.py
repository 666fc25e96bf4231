"""Pins logit_bias (its ranges, where it applies, its order with the penalties) and the log-probabilities a
row reports (the distribution, the top list's order and ties, the same tokens as `sample`)."""

import math

import pytest
import torch

from streamchat.model.sampling import (
    SamplingParams, TokenHistory, adjust_logits, logit_bias_pairs, make_generator, resolve_params, sample,
    sample_with_logprobs,
)

NAN, INF = float("nan"), float("inf")


def with_logprobs(logits, params):
    """sample_with_logprobs over rows of `logits` (a nested list) with fresh generators."""
    return sample_with_logprobs(torch.tensor(logits), params, [make_generator(p) for p in params])


# -- logit_bias: ranges ---------------------------------------------------------------------


@pytest.mark.parametrize("pairs", [(), ((0, -100.0),), ((0, 100), (7, -0.5)), tuple((i, 1.0) for i in range(300))])
def test_logit_bias_admits_openais_ranges(pairs):
    """Up to 300 increasing ids >= 0, biases in [-100, 100] (ints too)."""
    assert SamplingParams(logit_bias=pairs).validate().logit_bias == pairs


@pytest.mark.parametrize("pairs", [((0, 100.0001),), ((0, -101),), ((0, NAN),), ((0, INF),), ((0, True),),
                                   ((-1, 1.0),), ((3, 1.0), (2, 1.0)), ((3, 1.0), (3, 2.0)), ((1.0, 1.0),),
                                   tuple((i, 1.0) for i in range(301)), {0: 1.0}, ((0, 1.0, 2.0),)])
def test_logit_bias_refuses_outside_them(pairs):
    """A bias out of range or not a number, a negative, repeated or unsorted id, over 300 entries: ValueError."""
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=pairs).validate()


def test_logit_bias_ids_past_the_vocab_are_refused_only_with_the_vocab():
    params = SamplingParams(logit_bias=((49152, 5.0),))
    assert params.validate() is params
    with pytest.raises(ValueError, match="outside the vocabulary"):
        params.validate(vocab_size=49152)


def test_logit_bias_pairs_read_openais_json_keys():
    """String keys of ASCII digits or int keys; sorted by id; a token named twice or a bad key is refused."""
    assert logit_bias_pairs({"50256": -100, "7": 1.5, 3: 2}) == ((3, 2), (7, 1.5), (50256, -100))
    for bad in ({"-1": 1}, {"x": 1}, {"1.0": 1}, {"٣": 1}, {True: 1}, {"7": 1, "07": 2}):
        with pytest.raises(ValueError):
            logit_bias_pairs(bad)


def test_resolve_takes_a_mapping_and_the_upper_layer_replaces_the_whole_map():
    session = {"logit_bias": {"1": 5.0, "2": 5.0}, "logprobs": 3}
    assert resolve_params(SamplingParams(), session, {}).logit_bias == ((1, 5.0), (2, 5.0))
    resolved = resolve_params(SamplingParams(), session, {"logit_bias": {"9": -1.0}})
    assert resolved.logit_bias == ((9, -1.0),) and resolved.logprobs == 3
    with pytest.raises(ValueError, match="logprobs"):
        resolve_params(SamplingParams(), {}, {"logprobs": 21})


# -- logit_bias: the sampler ----------------------------------------------------------------


def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_one():
    row = [2.0, 9.0, 1.0, 3.0]
    assert sample(torch.tensor([row]), [SamplingParams(logit_bias=((2, 100.0),))], [None]) == [2]
    assert sample(torch.tensor([row]), [SamplingParams(logit_bias=((1, -100.0),))], [None]) == [3]


def test_logit_bias_applies_to_sampled_rows():
    """A +100 token takes all of a sampled row's mass; a -100 one none of it, across seeds."""
    row = torch.tensor([[2.0, 9.0, 1.0, 3.0]])
    forced = SamplingParams(0.7, 0.9, logit_bias=((0, 100.0),))
    banned = SamplingParams(1.0, logit_bias=((1, -100.0),))
    for seed in range(30):
        assert sample(row, [forced], [torch.Generator().manual_seed(seed)]) == [0]
        assert sample(row, [banned], [torch.Generator().manual_seed(seed)]) != [1]


def test_logit_bias_is_added_before_the_penalties_and_keeps_masks():
    """The biased logit's sign decides the repetition penalty; -inf stays -inf; ids past the vocab are ignored."""
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((0, 3.0), (1, 100.0), (2, -1.0), (9, 5.0)))
    got = adjust_logits(torch.tensor([[-1.0, -INF, 0.5]]), [params], [TokenHistory([0, 2], [])])
    assert got.tolist() == [[1.0, -INF, -1.0]]  # (-1 + 3) / 2; masked; (0.5 - 1) * 2


def test_corrupt_rows_ignore_the_bias():
    params = SamplingParams(logit_bias=((0, 100.0),))
    assert sample(torch.tensor([[NAN, 1.0, 2.0], [1.0, INF, 2.0]]), [params, params], [None, None]) == [2, 2]


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_adjusted_logits():
    """The chosen token's and the top list's logprobs are log_softmax after bias, before the temperature."""
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    params = [SamplingParams(logprobs=5), SamplingParams(0.7, 0.9, logprobs=20, logit_bias=((4, 7.0),)),
              SamplingParams(1.5, top_k=3, logprobs=0)]
    results = sample_with_logprobs(logits, params, [torch.Generator().manual_seed(1)] * 3)
    for row, (p, result) in enumerate(zip(params, results)):
        expected = torch.log_softmax(adjust_logits(logits[row:row + 1], [p], None)[0], dim=-1)
        assert math.isclose(result.logprobs.logprob, expected[result.token].item(), abs_tol=1e-5)
        assert [t.token for t in result.logprobs.top] == expected.topk(p.logprobs).indices.tolist()
        for entry in result.logprobs.top:
            assert math.isclose(entry.logprob, expected[entry.token].item(), abs_tol=1e-5)


def test_greedy_chosen_token_is_the_top_entry_exactly():
    torch.manual_seed(1)
    for result in sample_with_logprobs(torch.randn(4, 1000) * 5, [SamplingParams(logprobs=3)] * 4, [None] * 4):
        top = result.logprobs.top
        assert top[0].token == result.token and top[0].logprob == result.logprobs.logprob <= 0
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)


def test_ties_are_listed_by_lower_id_even_across_the_kth_place():
    """Four equal logits and k=2: the two lowest ids, whatever topk picked."""
    row = [0.0] * 300
    for i in (250, 7, 120, 3):
        row[i] = 5.0
    result = with_logprobs([row], [SamplingParams(logprobs=2)])[0]
    assert [t.token for t in result.logprobs.top] == [3, 7]
    assert result.logprobs.top[0].logprob == result.logprobs.top[1].logprob


def test_masked_tokens_are_left_out_of_the_top_list():
    result = with_logprobs([[1.0, -INF, 0.0, -INF]], [SamplingParams(logprobs=4)])[0]
    assert [t.token for t in result.logprobs.top] == [0, 2]
    assert math.isclose(math.exp(result.logprobs.top[0].logprob) + math.exp(result.logprobs.top[1].logprob), 1.0,
                        rel_tol=1e-6)


def test_corrupt_rows_report_their_finite_values():
    results = with_logprobs([[NAN, 1.0, 1.0], [-INF, -INF, -INF]], [SamplingParams(logprobs=3)] * 2)
    assert results[0].token == 1 and [t.token for t in results[0].logprobs.top] == [1, 2]
    assert results[0].logprobs.logprob == pytest.approx(math.log(0.5))
    assert results[1].token == 0 and results[1].logprobs == (-INF, ())


def test_rows_that_do_not_ask_report_none_and_tokens_equal_sample():
    """The same tokens as `sample` for the same generator states; only the asking rows report."""
    torch.manual_seed(2)
    logits = torch.randn(4, 2000) * 2
    params = [SamplingParams(0.8, 0.95, seed=s, logprobs=(s if s % 2 else None)) for s in range(4)]
    plain = sample(logits, params, [make_generator(p) for p in params])
    results = sample_with_logprobs(logits, params, [make_generator(p) for p in params])
    assert [r.token for r in results] == plain
    assert [r.logprobs is None for r in results] == [True, False, True, False]
    assert len(results[3].logprobs.top) == 3 and results[1].logprobs.top == results[1].logprobs.top[:1]
