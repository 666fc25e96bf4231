"""The sampled rows' truncation by a full sort of the vocabulary: min_p, then top-k, then top-p.

Owns the plainest statement of those rules, used for the rows whose kept
set the candidates of `sampling_draw` cannot settle (a nucleus wider than
them, a wide top_k). Costs a stable sort of every row it gets (~7 ms for
49,152 logits). Knows nothing of drawing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from streamchat.model.sampling_params import SamplingParams


def kept_by_sort(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """(S, vocab) scaled logits (row max 0) -> a copy with the logits min_p, top-k and top-p drop set to -inf."""
    floors = torch.tensor([min_p_floor(p) for p in params], device=z.device)
    z = z.masked_fill(z < floors[:, None], float("-inf"))
    filtered = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1.0]
    if filtered:
        z[filtered] = _top_k_top_p(z[filtered], [params[i] for i in filtered])
    return z


def min_p_floor(params: SamplingParams) -> float:
    """The least scaled logit min_p keeps: p / p_max = exp(z - 0) >= min_p is z >= ln(min_p); -inf when off."""
    return math.log(params.min_p) if params.min_p > 0 else -math.inf


def _top_k_top_p(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Sets to -inf the logits that top-k or top-p drop; the most likely token always stays.

    Ties with the k-th logit are kept. top-p keeps the smallest prefix, most
    likely first (ties: lower id first), whose probability reaches top_p.
    """
    vocab = x.shape[-1]
    k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params], device=x.device)
    # 1 would drop a tail whose rounded mass reaches 1: off is inf
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=x.device)
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # (F, vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])  # (F, 1)
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
