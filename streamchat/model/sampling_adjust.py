"""What happens to the raw logits before anything else: logit_bias, then the penalties.

Owns the order and the arithmetic of both (the rules are in
`streamchat.model.sampling`'s docstring) and doing them sparsely: a row's
changes touch only the ids in its bias map and its history, so the cost is
O(history + bias), never O(vocab). The touched logits are gathered, changed
and scattered back into one copy of the batch. Knows nothing of
temperature, truncation or drawing, nor of which rows are corrupt (the
caller leaves those out).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from streamchat.model.sampling_params import REPETITION_WINDOW, SamplingParams

FLOAT32_MAX = torch.finfo(torch.float32).max


class TokenHistory(NamedTuple):
    """What one row has seen, oldest first; the sampler reads it and keeps nothing.

    recent: the tail of context and reply (at least the last REPETITION_WINDOW
    tokens; earlier ones are ignored). generated: every token of the reply so
    far. Ids outside the vocabulary are ignored.
    """

    recent: Sequence[int]
    generated: Sequence[int]


class _Changes(NamedTuple):
    """Per touched logit, lists of one length: where it is and what to do to it."""

    pos: list[int]  # row * vocab + token id
    bias: list[float]
    repetition: list[float]  # the row's repetition_penalty if the id is in its window, else 1 (a no-op)
    frequency: list[float]  # the row's frequency_penalty times the id's count in its generated tokens
    presence: list[float]  # the row's presence_penalty if that count is positive, else 0


def adjust_logits(x: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory] | None,
                  rows: Sequence[int] | None = None) -> torch.Tensor:
    """(N, vocab) float32 logits without NaN or +inf in `rows` (default: all) -> logit_bias, then the penalties.

    Returns `x` itself when no row changes anything, else a changed copy;
    never changes `x`. Bias ids and history ids outside [0, vocab) are
    ignored; `history` None means no penalties. A finite logit stays finite
    (clamped to float32's range); -inf stays a mask.
    """
    vocab = x.shape[-1]
    changes = _Changes([], [], [], [], [])
    for row in range(len(params)) if rows is None else rows:
        _add_changes(changes, row, vocab, params[row], None if history is None else history[row])
    if not changes.pos:
        return x
    y = x.clone(memory_format=torch.contiguous_format)
    flat = y.view(-1)
    pos = torch.tensor(changes.pos, dtype=torch.int64, device=x.device)
    old = flat[pos]
    # one tensor for every column (a tensor from a list costs as much as the arithmetic); float32 as torch
    # would round each factor
    bias, repetition, frequency, presence = torch.tensor(changes[1:], dtype=torch.float32, device=x.device)
    new = old + bias
    new = torch.where(new > 0, new / repetition, new * repetition)  # HF/CTRL: the biased logit's sign decides
    new = new - frequency - presence
    # x * 10 can overflow float32: a finite logit stays finite; -inf stays a mask whatever the bias
    flat[pos] = torch.where(old == float("-inf"), old, new.clamp(-FLOAT32_MAX, FLOAT32_MAX))
    return y


def _add_changes(changes: _Changes, row: int, vocab: int, params: SamplingParams,
                 history: TokenHistory | None) -> None:
    """Appends the (row, id) pairs that row's bias and penalties touch, with what each asks."""
    bias = {token: b for token, b in params.logit_bias if token < vocab}
    seen: set[int] = set()
    counts: Counter[int] = Counter()
    if history is not None and params.repetition_penalty != 1:
        seen = {t for t in history.recent[-REPETITION_WINDOW:] if 0 <= t < vocab}
    if history is not None and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        counts = Counter(t for t in history.generated if 0 <= t < vocab)
    ids = list(bias.keys() | seen | counts.keys())
    base, r, f, p = row * vocab, params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    changes.pos.extend([base + t for t in ids])
    changes.bias.extend([bias.get(t, 0.0) for t in ids])
    changes.repetition.extend([r if t in seen else 1.0 for t in ids])
    changes.frequency.extend([f * counts[t] for t in ids])
    changes.presence.extend([p if counts[t] else 0.0 for t in ids])
