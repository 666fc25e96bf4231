"""The log-probabilities a row reports when its params ask (`SamplingParams.logprobs` not None).

Owns which distribution is reported, and the result types. It is the
model's distribution after logit_bias and the penalties and before the
temperature, min_p, top-k and top-p: log_softmax of the adjusted logits
over the whole vocabulary, for greedy and sampled rows alike. So a
response reports the same numbers at any temperature, a greedy one
reports more than 0 and -inf, and the chosen token's log-probability says
how likely the model found it, not how likely the truncated draw was. A
corrupt row (NaN or +inf) reports the distribution over its finite values,
without bias or penalties, as it is drawn.

Knows nothing of how the token was chosen: it is handed the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from streamchat.model.sampling_draw import take_rows
from streamchat.model.sampling_params import SamplingParams


class TopLogprob(NamedTuple):
    token: int
    logprob: float  # natural log, <= 0


class Logprobs(NamedTuple):
    """One row's report: the chosen token's log-probability and the `logprobs` most likely tokens'.

    `top` is most likely first, ties by lower id first, and leaves out tokens
    of probability 0 (so it can be shorter than asked). A row with no finite
    logit reports -inf for its token 0 and no alternatives.
    """

    logprob: float
    top: tuple[TopLogprob, ...]


def report_logprobs(x: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                    params: Sequence[SamplingParams]) -> list[Logprobs]:
    """x (N, vocab) float32 adjusted logits (a corrupt row as it came) -> one report per row in `rows`.

    `tokens[i]` and `params[i]` are row i's. Costs a logsumexp of the rows
    that ask and one topk of them all: a log-probability is the logit minus
    the row's logsumexp, in float32, so a token reports the same number as
    the chosen one and as an alternative.
    """
    sub = take_rows(x, list(rows))
    bad = ~torch.isfinite(sub.amax(dim=-1))  # NaN, +inf, or nothing finite: one pass finds all three
    if bool(bad.any()):
        # NaN and +inf as the greedy fallback sees them: out of the running
        sub = torch.where(bad[:, None] & ~torch.isfinite(sub), float("-inf"), sub)
    lse = torch.logsumexp(sub, dim=-1)[:, None]  # (R, 1); -inf for a row with nothing finite
    chosen = torch.tensor([tokens[i] for i in rows], device=x.device)[:, None]
    chosen_logprobs = (sub.gather(1, chosen) - lse)[:, 0].tolist()
    empty = (lse[:, 0] == float("-inf")).tolist()
    wanted = [min(params[i].logprobs or 0, sub.shape[-1]) for i in rows]
    # one more than the most asked for: a tie across a row's k-th place shows as equal values at k-1 and k
    values, ids = sub.topk(min(max(wanted) + 1, sub.shape[-1]), dim=-1)  # (R, width)
    top_logprobs = (values - lse).tolist()
    reports = []
    for j, (k, row_values, row_ids) in enumerate(zip(wanted, values.tolist(), ids.tolist())):
        if empty[j]:
            reports.append(Logprobs(float("-inf"), ()))
            continue
        ranked = _most_likely(sub[j], list(zip(row_values, row_ids, top_logprobs[j])), k)
        reports.append(Logprobs(chosen_logprobs[j], tuple(TopLogprob(i, lp) for _, i, lp in ranked)))
    return reports


def _most_likely(row: torch.Tensor, found: list[tuple[float, int, float]], k: int) -> list[tuple[float, int, float]]:
    """The k most likely (logit, id, logprob) of a (vocab,) row, from its topk (more than k of them when the
    row has more): logit descending, ties by lower id, -inf left out.

    topk may pick any of the logits tied with the k-th; when that tie
    reaches past the k-th place, the lowest ids among all of it are taken
    (a pass over the row; rare), so the answer never depends on topk's
    internals.
    """
    if k == 0:
        return []
    ranked = sorted(found, key=lambda entry: (-entry[0], entry[1]))
    kth, _, kth_logprob = ranked[k - 1]
    if len(ranked) > k and ranked[k][0] == kth:
        above = [entry for entry in ranked if entry[0] > kth]
        ties = (row == kth).nonzero()[:, 0][: k - len(above)].tolist()  # nonzero lists ids in increasing order
        ranked = above + [(kth, i, kth_logprob) for i in ties]
    return [entry for entry in ranked[:k] if entry[0] > float("-inf")]
