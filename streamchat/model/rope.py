"""Rotary tables: a model's rope settings as inverse frequencies, and cos/sin tables grown on demand.

Owns the one way any architecture's rope settings become float32 tables in
the rotate-half layout the attention backends read (the halves repeat:
cos[p] = cos(p * inv_freq) twice over). Rope types other than the plain one
(llama3, yarn, ...) come from transformers' own initialisers, with the
attention factor they return. Knows nothing about attention or the pool.
"""

from __future__ import annotations

import torch


def rope_parameters(config) -> dict:
    """The config's rope settings (transformers 5 `rope_parameters`, or the older `rope_scaling`)."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def inv_freq(config, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim // 2,) and the attention factor of the model's rope, over `dim` dims."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


class RopeTables:
    """cos/sin (num_positions, dim) float32 on the model's device, each times `scaling`, grown on
    demand (at least doubling, at least 4,096 rows): a table handed out stays valid until it grows."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, device: torch.device) -> None:
        self.inv_freq, self.scaling, self.device = inv_freq, scaling, device
        dim = 2 * inv_freq.shape[0]
        self.cos = self.sin = torch.empty(0, dim)

    def get(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos.shape[0] < num_positions:
            n = max(num_positions, 2 * self.cos.shape[0], 4096)
            t = torch.arange(n, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = (emb.cos() * self.scaling).to(self.device)
            self.sin = (emb.sin() * self.scaling).to(self.device)
        return self.cos, self.sin
