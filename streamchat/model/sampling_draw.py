"""Drawing each sampled row's token: temperature, min_p, top-k, top-p, then one uniform through an inverse CDF.

Owns the sampled rows' rules (listed in `streamchat.model.sampling`) and
their fast form. A row's kept set is looked for among its `CANDIDATES`
largest logits, found from the maxima of 64-wide blocks rather than by a
sort or a topk of the vocabulary. That is exact whenever the kept set
provably lies among them: every logit above the row's bound is a candidate,
so a kept set bounded by a threshold above it, or cut by top-p before it,
is the set a full sort finds, in the same order (value, then lower id).

    sorted scaled logits   0 ... -0.3 ... -2.1 | -2.1 ... -9.8 | <= bound ...
                           [ kept (top-p cut)  ][ candidates   ][ never looked at ]

Past the extraction, a row is plain Python over its candidates that stops
at the cut: cheaper than the dozens of tiny tensor ops it replaces. Rows
the candidates cannot settle (a nucleus wider than them, a wide top_k) and
rows that keep everything (temperature alone) are done over the whole row,
with `sampling_sort` for the truncation. Knows nothing of penalties,
generators, greedy or corrupt rows: every row has a finite max and no NaN
or +inf.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch

from streamchat.model.sampling_params import SamplingParams
from streamchat.model.sampling_sort import kept_by_sort, min_p_floor

# On the bundled model at temperature 0.7 and top_p 0.9, 99.9% of nuclei hold
# under 128 tokens (931 decode steps, 8 prompts; the widest held 192).
CANDIDATES = 128
# A top_k up to this many widens the candidates to hold it; past it, the sort.
MAX_CANDIDATES = 1024
# The max of each 64-wide block is one vectorized pass; a topk of 49,152
# logits costs ~10x that (2 CPU threads).
_BLOCK = 64


class Candidates(NamedTuple):
    """Rows' largest scaled logits, in the full sort's order (value descending, ties by lower id)."""

    values: list[list[float]]
    ids: list[list[int]]
    bounds: list[float]  # every scaled logit outside the row's candidates is <= it (-inf: none has weight)
    top: torch.Tensor  # (F, 1) each row's max logit, unscaled


def draw(x: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> list[int]:
    """(S, vocab) float32 logits of sampled rows and one uniform in [0, 1) per row -> one token id per row.

    Row i's token depends only on row i's logits, params and uniform.
    """
    vocab = x.shape[-1]
    tokens: list[int | None] = [None] * len(params)
    # top_k at or past the vocab keeps everything: such a row draws as if it were off, token for token
    truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0]
    if truncated:
        drawn = _draw_candidates(take_rows(x, truncated), [params[i] for i in truncated],
                                 [uniforms[i] for i in truncated])
        for i, token in zip(truncated, drawn):
            tokens[i] = token
    rest = [i for i, token in enumerate(tokens) if token is None]
    if rest:
        drawn = _draw_whole(take_rows(x, rest), [params[i] for i in rest], [uniforms[i] for i in rest])
        for i, token in zip(rest, drawn):
            tokens[i] = token
    return tokens  # type: ignore[return-value]  # every row filled


def _draw_whole(x: torch.Tensor, params: Sequence[SamplingParams], uniforms: list[float]) -> list[int]:
    """The draw over every logit of each row: truncated by a full sort where anything truncates."""
    z = scaled(x, params)
    if any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params):
        z = kept_by_sort(z, params)
    u = torch.tensor(uniforms, dtype=torch.float64, device=x.device)
    return inverse_cdf(torch.exp(z), u).tolist()


def scaled(x: torch.Tensor, params: Sequence[SamplingParams], top: torch.Tensor | None = None) -> torch.Tensor:
    """(S, vocab) -> (x - row max) / temperature: every value <= 0 or -inf, whatever the admitted temperature.

    `top`: the (S, 1) row maxima when the caller has them."""
    z = x - (x.amax(dim=-1, keepdim=True) if top is None else top)
    return z.div_(_temperatures(params, x.device)[:, None])


def _temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    return torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(R, n) non-negative weights, each row with a positive one, and (R,) uniforms in [0, 1) -> (R,) positions.

    The first position whose cumulative weight exceeds uniform * total, so a
    position of weight 0 is never drawn (rounding that reaches the total
    falls back to the last positive weight).
    """
    cdf = weights.double().cumsum(-1)  # (R, n)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(drawn, last)[:, 0]


class Kept(NamedTuple):
    """A row's kept set when its candidates settle it: ids and scaled logits, most likely first."""

    ids: list[int]
    values: list[float]


def _draw_candidates(x: torch.Tensor, params: Sequence[SamplingParams], uniforms: list[float]) -> list[int | None]:
    """Each row's token drawn among its candidates, or None where the kept set may reach past them."""
    return [None if kept is None else kept.ids[_pick([math.exp(v) for v in kept.values], u)]
            for kept, u in zip(kept_candidates(x, params), uniforms)]


def kept_candidates(x: torch.Tensor, params: Sequence[SamplingParams]) -> list[Kept | None]:
    """(F, vocab) float32 logits -> each row's kept set under min_p, top-k and top-p, or None where it may
    reach past the row's candidates (then only the full sort knows it)."""
    vocab = x.shape[-1]
    top_k = [p.top_k if p.top_k < vocab else 0 for p in params]  # k >= vocab keeps everything
    width = min(vocab, max([CANDIDATES] + [k for k in top_k if k <= MAX_CANDIDATES]))
    c = candidates(x, params, width)
    thresholds = [_threshold(values, k, p) for values, k, p in zip(c.values, top_k, params)]
    # top-p measures mass over everything min_p and top-k keep: the whole row, unless that lies among the candidates
    whole = [i for i, p in enumerate(params) if p.top_p < 1 and not _inside(thresholds[i], c.bounds[i])]
    masses = dict(zip(whole, _masses(x, whole, c.top, params, thresholds)))
    kept: list[Kept | None] = []
    for i, p in enumerate(params):
        n = None if top_k[i] > width else _num_kept(c.values[i], c.bounds[i], thresholds[i], p.top_p, masses.get(i))
        kept.append(None if n is None else Kept(c.ids[i][:n], c.values[i][:n]))
    return kept


def candidates(x: torch.Tensor, params: Sequence[SamplingParams], width: int) -> Candidates:
    """(F, vocab) float32 logits -> at least the `width` largest of each row, scaled as `scaled` scales them.

    Scaling keeps the order (it may only make ties), so the largest logits
    are the largest scaled ones and a bound in logits is one in scaled ones.
    """
    values, ids, bound = _largest(x, width)
    top = values[:, :1]  # the row's max is its largest candidate
    temperature = _temperatures(params, x.device)[:, None]
    values = ((values - top) / temperature).tolist()
    ids = ids.tolist()
    for row_values, row_ids in zip(values, ids):
        _ties_by_id(row_values, row_ids)
    return Candidates(values, ids, ((bound - top) / temperature)[:, 0].tolist(), top)


def _largest(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(F, vocab) -> the `width` largest logits of each row, value descending, with their ids and an (F, 1)
    bound: every logit outside them is <= it (-inf when they are the whole row)."""
    num_rows, vocab = x.shape
    num_blocks = vocab // _BLOCK
    if vocab % _BLOCK or num_blocks <= width or not x.is_contiguous():
        values, ids = x.topk(min(width, vocab), dim=-1)
        bound = values[:, -1:] if width < vocab else torch.full_like(values[:, :1], float("-inf"))
        return values, ids, bound
    blocks = x.view(num_rows, num_blocks, _BLOCK)
    # the `width` blocks with the largest maxima hold the `width` largest logits; the next block's max
    # bounds everything outside them
    block_max, block_ids = blocks.amax(dim=-1).topk(width + 1, dim=-1)  # (F, width + 1)
    block_ids = block_ids[:, :width, None]  # (F, width, 1)
    inside = blocks.gather(1, block_ids.expand(-1, -1, _BLOCK)).view(num_rows, -1)  # (F, width * BLOCK)
    inside_ids = (block_ids * _BLOCK + torch.arange(_BLOCK, device=x.device)).view(num_rows, -1)
    values, where = inside.topk(width, dim=-1)
    return values, inside_ids.gather(1, where), torch.maximum(values[:, -1:], block_max[:, width:])


def _ties_by_id(values: list[float], ids: list[int]) -> None:
    """Reorders, in place, each run of equal values (descending list) by increasing id: the full sort's order,
    which topk does not promise."""
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end] != values[start]:
            if end - start > 1:
                ids[start:end] = sorted(ids[start:end])
            start = end


def _threshold(values: list[float], top_k: int, params: SamplingParams) -> float:
    """The least scaled logit min_p and top-k keep: max(ln min_p, the k-th largest), as float32 compares.

    min_p drops first, then top-k counts what is left; either way what stays
    is every logit at or above the larger of the two.
    """
    floor = _float32(min_p_floor(params))
    return max(floor, values[top_k - 1]) if 0 < top_k <= len(values) else floor


def _inside(threshold: float, bound: float) -> bool:
    """Whether every logit at or above the threshold (with any weight) is a candidate."""
    return threshold > bound or bound == -math.inf


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _masses(x: torch.Tensor, rows: list[int], top: torch.Tensor, params: Sequence[SamplingParams],
            thresholds: list[float]) -> list[float]:
    """For `rows` of x: the sum of exp(scaled logit) over the whole row, counting those >= the threshold."""
    if not rows:
        return []
    z = scaled(take_rows(x, rows), [params[i] for i in rows], top[rows])
    cut = [thresholds[i] for i in rows]
    below = z < torch.tensor(cut, device=x.device)[:, None] if max(cut) > -math.inf else None
    weights = z.exp_()
    if below is not None:
        weights.masked_fill_(below, 0.0)
    return weights.sum(-1).tolist()


def _num_kept(values: list[float], bound: float, threshold: float, top_p: float, mass: float | None) -> int | None:
    """How many leading candidates the row keeps, or None when its kept set may reach past them.

    `mass`: the whole row's, when the threshold set may reach past the candidates.
    """
    inside = _inside(threshold, bound)
    if top_p < 1 and mass is None:
        mass = math.fsum(math.exp(v) for v in values if v >= threshold)
    limit = top_p * mass if top_p < 1 else math.inf  # type: ignore[operator]  # mass is set when top_p < 1
    num_kept, kept_mass = 0, 0.0
    for v in values:
        if v < threshold or (num_kept and kept_mass >= limit):
            break
        num_kept += 1
        kept_mass += math.exp(v)
    # a top-p cut drops the next logit of the full order, candidate or not; the kept ones are all candidates
    # when the last of them is above the bound
    cut = kept_mass >= limit
    return num_kept if inside or (cut and values[num_kept - 1] > bound) else None


def _pick(weights: list[float], uniform: float) -> int:
    """The first position whose cumulative weight exceeds uniform * total; never one of weight 0."""
    cumulative = list(itertools.accumulate(weights))
    target = uniform * cumulative[-1]
    for j, (w, c) in enumerate(zip(weights, cumulative)):
        if c > target and w > 0:
            return j
    return max(j for j, w in enumerate(weights) if w > 0)  # rounding reached the total


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows`: t itself when they are all of them in order (no copy)."""
    return t if rows == list(range(t.shape[0])) else t[rows]
