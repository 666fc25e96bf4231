"""What every model class here shares around its layers: the step's plan, RMSNorm, rope tables, logits.

A model class (`llama.LlamaModel`, `deepseek.DeepseekModel`) sets `shape`
(num_layers, num_heads, rms_norm_eps, max_position_embeddings, ...), `rope`
(a `RopeTables`), `backend`, `dtype`, `small_norm`, `final_norm` and
`lm_head`, and owns its layers and `forward`. Knows nothing about any one
architecture's layers.
"""

from __future__ import annotations

import torch

from streamchat.model.attention import AttentionMetadata, Heads, StepPlan, plan_step
from streamchat.model.norm import rms_norm


class DecoderModel:
    captures_graphs = True  # a decode step may be captured as a CUDA graph (no host sync inside forward)

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (num_positions, rotary dims) in float32, grown on demand."""
        return self.rope.get(num_positions)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.shape.rms_norm_eps, self.small_norm)

    def step_plan(self, meta: AttentionMetadata, positions: torch.Tensor, heads: Heads,
                  block_mass: torch.Tensor | None) -> StepPlan:
        """The plan every layer of the step shares, over rope tables that cover every cache position."""
        widths = [g.block_tables.shape[1] for g in (meta.decode, meta.prefill) if g is not None]
        cos, sin = self.rope_tables(max(widths, default=1) * meta.block_size)
        return plan_step(self.backend, meta, positions, cos, sin, self.dtype, heads, block_mass)

    def logits(self, h: torch.Tensor, logits_idx: torch.Tensor | None) -> torch.Tensor | None:
        """float32 logits (N, vocab) of the final hidden states' rows `logits_idx` (None: none wanted)."""
        if logits_idx is None:
            return None
        return self.lm_head(self.rms_norm(h[logits_idx], self.final_norm)).float()
