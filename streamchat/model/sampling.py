"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.

Owns the per-request sampling parameters and a generator per seeded request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits (N, vocab) float32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[row] = _sample_row(logits[row], p, gen)
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits.float().cpu() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # the first always stays
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=gen).item())
