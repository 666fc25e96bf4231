"""Choosing the next token from logits: logit_bias, penalties, greedy, temperature, min-p, top-k, top-p, seeded.

Owns the numeric rules that make every admitted value safe ("Sampling
numbers" in docs/protocol.md) and a generator per seeded request. The params
themselves, their ranges and defaults live in the torch-free
`streamchat.model.sampling_params` (re-exported here). It knows nothing of
sessions, the scheduler or the wire: a caller that wants penalties hands
each row its `TokenHistory`. The work is split three ways:
`sampling_adjust` (bias and penalties), `sampling_draw` (sampled rows),
`sampling_logprobs` (what a row reports).

Rules, all enforced here whatever the parser let through:

- A row holding NaN or +inf is corrupt: greedy over its finite values, no
  bias, no penalties. A row with no finite value gives token 0. Neither
  advances the row's generator.
- logit_bias comes first, added to the raw logits, in every row that sets
  it, greedy rows too; ids outside the vocabulary are ignored.
- Then the penalties, in every row that sets them, greedy rows too:
  repetition_penalty over the last REPETITION_WINDOW tokens of
  `history.recent` (the biased logit's sign decides), then frequency and
  presence over `history.generated`. Without a history there is nothing to
  penalize. A changed finite logit stays finite (clamped to float32's
  range); -inf stays a mask whatever the bias.
- A temperature below TEMPERATURE_FLOOR is greedy: exactly argmax of the
  adjusted logits (the lowest id among ties).
- Sampled rows are shifted by their max before dividing by the temperature,
  so every logit is <= 0 and no admitted value makes inf or NaN. Then min_p
  (keep p >= min_p * p_max), then top-k (the k largest, ties with the k-th
  kept), then top-p (the smallest prefix, most likely first and ties by
  lower id, whose probability over what min_p and top-k kept reaches
  top_p). The most likely token is always kept; the token is drawn in
  proportion to exp(scaled logit) over the kept set.
- A sampled row draws one uniform in [0, 1): a seeded row from its own
  generator, so its token depends only on its own logits, params, history
  and generator, never on the other rows; the others from torch's default
  generator.
- `logits` is never changed, and nothing raises for params `validate()`
  admits, whatever the logits hold.
- Log-probabilities, for a row whose params ask: see `sampling_logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from streamchat.model.sampling_adjust import FLOAT32_MAX, TokenHistory, adjust_logits
from streamchat.model.sampling_draw import draw, take_rows
from streamchat.model.sampling_logprobs import Logprobs, TopLogprob, report_logprobs
from streamchat.model.sampling_params import (
    DEFAULT_PARAMS, INT64_MAX, INT64_MIN, LOGIT_BIAS_MAX, LOGIT_BIAS_MAX_ENTRIES, PENALTY_MAX, REPETITION_PENALTY_MAX,
    REPETITION_WINDOW, REQUEST_FIELDS, SAMPLING_FIELDS, SEED_MAX, SEED_MIN, TEMPERATURE_FLOOR, TEMPERATURE_MAX,
    TOP_K_MAX, TOP_LOGPROBS_MAX, SamplingParams, load_model_defaults, logit_bias_pairs, resolve_params,
)

__all__ = [  # the sampler's own names, and the params' re-exported for its callers
    "TokenHistory", "Sampled", "Logprobs", "TopLogprob", "make_generator", "sample", "sample_with_logprobs",
    "adjust_logits", "FLOAT32_MAX",
    "DEFAULT_PARAMS", "INT64_MAX", "INT64_MIN", "LOGIT_BIAS_MAX", "LOGIT_BIAS_MAX_ENTRIES", "PENALTY_MAX",
    "REPETITION_PENALTY_MAX", "REPETITION_WINDOW", "REQUEST_FIELDS", "SAMPLING_FIELDS", "SEED_MAX", "SEED_MIN",
    "TEMPERATURE_FLOOR", "TEMPERATURE_MAX", "TOP_K_MAX", "TOP_LOGPROBS_MAX",
    "SamplingParams", "load_model_defaults", "logit_bias_pairs", "resolve_params",
]

# argmax on the CPU keeps an index per element and runs ~5x slower than amax
# over 16 rows of 49,152 logits; blocks this wide find the first max with amax.
# One row is left to argmax: it runs on one thread, where amax's three
# parallel passes each wake the other thread (costly on a loaded machine).
_ARGMAX_BLOCK = 64


class Sampled(NamedTuple):
    """One row's outcome: its token, and its log-probabilities when its params ask (else None)."""

    token: int
    logprobs: Logprobs | None


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           history: Sequence[TokenHistory] | None = None) -> list[int]:
    """logits (N, vocab), any float dtype and device -> one token id per row.

    `generators[i]` is row i's (`make_generator(params[i])`, kept across the
    response's steps); `history[i]` its TokenHistory (None: no row has one,
    so penalties change nothing). The rules are the module's.
    """
    return _choose(logits, params, generators, history)[0]


def sample_with_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator | None],
                         history: Sequence[TokenHistory] | None = None) -> list[Sampled]:
    """`sample`, and for each row whose `params.logprobs` is not None its log-probabilities (the same tokens
    as `sample` for the same generator states). Rows that do not ask cost nothing more."""
    tokens, x = _choose(logits, params, generators, history)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    reports = dict(zip(asking, report_logprobs(x, asking, tokens, params))) if asking else {}
    return [Sampled(token, reports.get(i)) for i, token in enumerate(tokens)]


def _choose(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
            history: Sequence[TokenHistory] | None) -> tuple[list[int], torch.Tensor]:
    """The tokens, and the float32 logits they came from (adjusted; a corrupt row as it came)."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    assert history is None or len(history) == len(params)
    x = logits.float()
    # one pass: a row's max is NaN if it holds one (amax propagates NaN), +inf if it holds +inf, and
    # -inf if nothing in it is finite; -inf alone is a mask, not corruption
    corrupt = [not math.isfinite(m) for m in x.amax(dim=-1).tolist()]
    changing = [i for i, p in enumerate(params)
                if not corrupt[i] and (p.logit_bias or (p.penalized and history is not None))]
    if changing:
        x = adjust_logits(x, params, history, changing)
    greedy = [i for i, p in enumerate(params) if p.greedy and not corrupt[i]]
    bad = [i for i, c in enumerate(corrupt) if c]
    sampled = [i for i, p in enumerate(params) if not p.greedy and not corrupt[i]]
    tokens = [0] * len(params)
    for rows, choose in ((greedy, _first_max), (bad, _first_finite_max)):
        if rows:
            for i, token in zip(rows, choose(take_rows(x, rows))):
                tokens[i] = token
    if sampled:
        uniforms = _uniforms([generators[i] for i in sampled])
        for i, token in zip(sampled, draw(take_rows(x, sampled), [params[i] for i in sampled], uniforms)):
            tokens[i] = token
    return tokens, x


def _first_max(x: torch.Tensor) -> list[int]:
    """(N, vocab) float32 without NaN -> torch.argmax(x, -1): the first index of each row's max."""
    n, vocab = x.shape
    if n == 1 or vocab % _ARGMAX_BLOCK or x.device.type != "cpu" or not x.is_contiguous():
        return x.argmax(dim=-1).tolist()
    blocks = x.view(n, vocab // _ARGMAX_BLOCK, _ARGMAX_BLOCK)  # (N, num_blocks, BLOCK)
    block = blocks.amax(dim=-1).argmax(dim=-1)  # (N,) the first block holding the max
    inner = blocks[torch.arange(n), block].argmax(dim=-1)  # (N,) its first max
    return [b * _ARGMAX_BLOCK + i for b, i in zip(block.tolist(), inner.tolist())]


def _first_finite_max(x: torch.Tensor) -> list[int]:
    """Argmax over each row's finite values; a row with none gives 0 (all -inf: the first)."""
    return _first_max(x.masked_fill(~torch.isfinite(x), float("-inf")))


def _uniforms(generators: Sequence[torch.Generator | None]) -> list[float]:
    """One float64 in [0, 1) per sampled row: a seeded row's from its own (CPU) generator, the others' from
    torch's default one."""
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    shared = torch.rand(len(unseeded), dtype=torch.float64).tolist() if unseeded else []
    values = [0.0] * len(generators)
    for i, u in zip(unseeded, shared):
        values[i] = u
    for i, gen in enumerate(generators):
        if gen is not None:
            values[i] = torch.rand((), generator=gen, dtype=torch.float64).item()
    return values
