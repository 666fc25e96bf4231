"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.

Owns the per-request sampling parameters, the ranges they may take, a
generator per seeded request, and the numeric rules that make every admitted
value safe ("Sampling numbers" in docs/protocol.md). It knows nothing of
sessions, the scheduler or the wire. The protocol parser is torch-free, so it
repeats the ranges below; a test keeps the two copies equal.

Rules, all enforced here whatever the parser let through:

- `validate()` admits temperature in [0, 2], top_p in (0, 1], top_k an int
  in [0, 2^63-1] (0: off; beyond the vocabulary: the whole vocabulary) and
  seed None or an int in [-2^63, 2^63-1]; NaN, infinities and bools are
  refused.
- A temperature below TEMPERATURE_FLOOR is greedy: exactly argmax.
- Sampled rows are shifted by their max before dividing by the temperature,
  so every logit is <= 0 and no admitted value makes inf or NaN.
- top-p keeps the most likely token whatever top_p is.
- A row holding NaN or +inf is corrupt: greedy over its finite values. A row
  with no finite value gives token 0. Neither advances the row's generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TEMPERATURE_MAX = 2.0
# Below 1e-4 a logit gap of 0.01 already scales to a factor under e^-100
# (~4e-44, at the bottom of float32's subnormals): sampling would be argmax
# except among exact near-ties, so it is argmax, which is also deterministic.
# It also keeps 1/temperature a normal float32 (a float32 of 1e-300 is 0).
TEMPERATURE_FLOOR = 1e-4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Signed 64 bits, so a seed fits an int64 anywhere it is kept. manual_seed
# also takes [2^63, 2^64), but those alias the negative seeds. The CPU
# generator (mt19937) keeps only the low 32 bits: seeds equal modulo 2^32
# draw the same tokens.
SEED_MIN, SEED_MAX = INT64_MIN, INT64_MAX
TOP_K_MAX = INT64_MAX  # fits an int64 tensor or column; larger is pointless anyway


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Returns self, or raises ValueError for a value outside the admitted ranges."""
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k must be an integer in [0, 2^63-1], got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63-1], got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits (N, vocab), any float dtype and device -> one token id per row.

    Never raises for params that `validate()` accepts, whatever the logits
    hold. Rows that sample share one softmax; a seeded row's token depends
    only on its own logits, params and generator, not on the other rows.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    tokens, corrupt = _greedy(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy and not corrupt[i]]
    if rows:
        x = logits[rows].float()  # (S, vocab), left on its device: only the drawn ids come back
        drawn = _draw(_probs(x, [params[i] for i in rows]), [generators[i] for i in rows])
        for i, token in zip(rows, drawn):
            tokens[i] = token
    return tokens


def _greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Argmax over each row's finite values (0 if none), and which rows cannot be sampled.

    A row cannot be sampled when it holds NaN or +inf, or no finite value.
    -inf alone is a mask (a token that must not come), not corruption.
    """
    x = logits.float()
    finite = torch.isfinite(x)
    tokens = x.masked_fill(~finite, float("-inf")).argmax(dim=-1)  # all -inf: the first, 0
    corrupt = (torch.isnan(x) | (x == float("inf"))).any(dim=-1) | ~finite.any(dim=-1)
    return tokens.tolist(), corrupt.tolist()


def _probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(S, vocab) float32 logits, each row with a finite max and no NaN or +inf -> probabilities."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]  # every value <= 0 or -inf
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
