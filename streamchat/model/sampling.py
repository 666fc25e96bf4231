"""Choosing the next token from logits: penalties, greedy, temperature, min-p, top-k, top-p, seeded.

Owns the numeric rules that make every admitted value safe ("Sampling
numbers" in docs/protocol.md) and a generator per seeded request. The params
themselves, their ranges and defaults live in the torch-free
`streamchat.model.sampling_params` (re-exported here). It knows nothing of
sessions, the scheduler or the wire: a caller that wants penalties hands
each row its `TokenHistory`.

Rules, all enforced here whatever the parser let through:

- A row holding NaN or +inf is corrupt: greedy over its finite values, no
  penalties. A row with no finite value gives token 0. Neither advances the
  row's generator.
- Penalties come first, on the raw logits, in every row that sets them,
  greedy rows too: repetition_penalty over the last REPETITION_WINDOW tokens
  of `history.recent`, then frequency and presence over `history.generated`.
  A penalized finite logit stays finite (clamped to float32's range); -inf
  stays a mask. Without a history there is nothing to penalize.
- A temperature below TEMPERATURE_FLOOR is greedy: exactly argmax of the
  (penalized) logits.
- Sampled rows are shifted by their max before dividing by the temperature,
  so every logit is <= 0 and no admitted value makes inf or NaN. Then min_p,
  then top-k and top-p, each keeping the most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from streamchat.model.sampling_params import (
    DEFAULT_PARAMS, INT64_MAX, INT64_MIN, PENALTY_MAX, REPETITION_PENALTY_MAX, REPETITION_WINDOW,
    SAMPLING_FIELDS, SEED_MAX, SEED_MIN, TEMPERATURE_FLOOR, TEMPERATURE_MAX, TOP_K_MAX, SamplingParams,
    load_model_defaults, resolve_params,
)

__all__ = [  # the sampler's own names, and the params' re-exported for its callers
    "TokenHistory", "make_generator", "sample", "apply_penalties", "FLOAT32_MAX",
    "DEFAULT_PARAMS", "INT64_MAX", "INT64_MIN", "PENALTY_MAX", "REPETITION_PENALTY_MAX", "REPETITION_WINDOW",
    "SAMPLING_FIELDS", "SEED_MAX", "SEED_MIN", "TEMPERATURE_FLOOR", "TEMPERATURE_MAX", "TOP_K_MAX",
    "SamplingParams", "load_model_defaults", "resolve_params",
]

FLOAT32_MAX = torch.finfo(torch.float32).max


class TokenHistory(NamedTuple):
    """What one row has seen, oldest first; the sampler reads it and keeps nothing.

    recent: the tail of context and reply (at least the last REPETITION_WINDOW
    tokens; earlier ones are ignored). generated: every token of the reply so
    far. Ids outside the vocabulary are ignored.
    """

    recent: Sequence[int]
    generated: Sequence[int]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           history: list[TokenHistory] | None = None) -> list[int]:
    """logits (N, vocab), any float dtype and device -> one token id per row.

    `history[i]` is row i's TokenHistory (None: no row has one, so penalties
    change nothing). Never raises for params that `validate()` accepts,
    whatever the logits hold. Rows that sample share one softmax; a seeded
    row's token depends only on its own logits, params, history and
    generator, not on the other rows. Never changes `logits`.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    assert history is None or len(history) == len(params)
    x = logits.float()
    corrupt = _corrupt(x)
    penalized = [i for i, p in enumerate(params) if p.penalized and not corrupt[i]]
    if penalized and history is not None:
        x = x.index_put((torch.tensor(penalized, device=x.device),),
                        apply_penalties(x[penalized], [params[i] for i in penalized],
                                        [history[i] for i in penalized]))
    tokens = _greedy(x, corrupt)
    rows = [i for i, p in enumerate(params) if not p.greedy and not corrupt[i]]
    if rows:
        sub = x[rows]  # (S, vocab), left on its device: only the drawn ids come back
        drawn = _draw(_probs(sub, [params[i] for i in rows]), [generators[i] for i in rows])
        for i, token in zip(rows, drawn):
            tokens[i] = token
    return tokens


def _corrupt(x: torch.Tensor) -> list[bool]:
    """Which rows of (N, vocab) float32 cannot be sampled: NaN or +inf, or no finite value.

    -inf alone is a mask (a token that must not come), not corruption.
    """
    # one pass: a row's max is NaN if it holds one (amax propagates NaN), +inf if it holds +inf, and
    # -inf if nothing in it is finite
    return (~torch.isfinite(x.amax(dim=-1))).tolist()


def _greedy(x: torch.Tensor, corrupt: list[bool]) -> list[int]:
    """Argmax over each row's finite values; a row with none gives 0."""
    if not any(corrupt):  # no NaN or +inf anywhere, and -inf never wins a row that has a finite value
        return x.argmax(dim=-1).tolist()
    finite = torch.isfinite(x)
    return x.masked_fill(~finite, float("-inf")).argmax(dim=-1).tolist()  # all -inf: the first, 0


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], history: list[TokenHistory]) -> torch.Tensor:
    """(P, vocab) float32 logits without NaN or +inf -> a penalized copy; all rows at once.

    repetition_penalty (HF/CTRL): a token in the row's last REPETITION_WINDOW
    tokens has a positive logit divided by r, a negative one multiplied by r.
    Then OpenAI's: logit -= frequency_penalty * count + presence_penalty *
    (count > 0), counts over the reply's generated tokens.
    """
    vocab, device = x.shape[-1], x.device
    rep = _column([p.repetition_penalty for p in params], device)  # (P, 1)
    freq = _column([p.frequency_penalty for p in params], device)
    pres = _column([p.presence_penalty for p in params], device)
    seen = _counts([h.recent[-REPETITION_WINDOW:] for h in history], vocab, device) > 0  # (P, vocab)
    counts = _counts([h.generated for h in history], vocab, device)  # (P, vocab)
    y = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    y = y - freq * counts - pres * (counts > 0).float()
    # a finite logit stays finite (x * 10 can overflow float32); -inf stays a mask
    return torch.where(x == float("-inf"), x, y.clamp(-FLOAT32_MAX, FLOAT32_MAX))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(rows), vocab) float32: how often each token id occurs in each row (ids outside [0, vocab) dropped)."""
    lengths = torch.tensor([len(r) for r in rows], device=device)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)  # (total,)
    row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)  # (total,)
    keep = (ids >= 0) & (ids < vocab)
    flat = row_idx[keep] * vocab + ids[keep]
    return torch.bincount(flat, minlength=len(rows) * vocab).view(len(rows), vocab).float()


def _probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(S, vocab) float32 logits, each row with a finite max and no NaN or +inf -> probabilities."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]  # every value <= 0 or -inf
    # min_p: p / p_max = exp(x - 0), so p >= min_p * p_max is x >= ln(min_p); the max (0) always stays
    floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=x.device)
    x = x.masked_fill(x < floor[:, None], float("-inf"))
    filtered = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1.0]
    if filtered:
        x[filtered] = _top_k_top_p(x[filtered], [params[i] for i in filtered])
    return torch.softmax(x, dim=-1)


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets to -inf the logits that top-k or top-p drop; the most likely token always stays.

    Ties with the k-th logit are kept. top-p keeps the smallest prefix, most
    likely first, whose probability reaches top_p.
    """
    vocab = x.shape[-1]
    k = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in params], device=x.device)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=x.device)
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # (F, vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])  # (F, 1)
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None].float()
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of (S, vocab) probabilities: seeded rows each from their own generator."""
    tokens = [0] * len(generators)
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    if unseeded:
        for i, token in zip(unseeded, torch.multinomial(probs[unseeded], 1).flatten().tolist()):
            tokens[i] = token
    for i, gen in enumerate(generators):
        if gen is not None and probs.device.type == "cpu":
            tokens[i] = int(torch.multinomial(probs[i], 1, generator=gen).item())
        elif gen is not None:
            tokens[i] = draw_inverse(probs[i], gen)
    return tokens


def draw_inverse(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (vocab,) row on any device, by one uniform from a CPU generator: the first
    token whose cumulative probability passes it. A token of probability 0 is never drawn."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()  # in [0, 1)
    cdf = probs.double().cumsum(0)
    return int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).clamp_(max=probs.shape[0] - 1).item())
