"""Our own forward pass for the Llama family over a flat varlen batch.

Owns the math of one step: RMSNorm, the rotary tables, grouped-query attention
through the paged pool (via an attention backend, which applies the rotary
embedding: keys by their offset in their block when written, queries per
block when attending), SwiGLU, tied or untied embeddings. Input is a flat
batch of tokens from many sequences with their cache positions and attention
metadata, never a padded rectangle.
Knows nothing about scheduling, sessions or block bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from streamchat.kernels import cpu
from streamchat.model.attention import AttentionMetadata, Heads, LayerKV, attend, plan_step
from streamchat.model.qlinear import Linear
from streamchat.model.weights import LinearBuilder


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, config) -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.vocab_size, config.rms_norm_eps,
                   config.max_position_embeddings)


@dataclass
class LayerWeights:
    """Norm weights dense; projections in the served weight format (`qlinear`)."""

    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q + 2 kv: q, k, v projections fused (with their bias, if any)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 inter: gate and up fused
    down: Linear


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling from the model's own rope settings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = ModelShape.from_hf(config).head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


class LlamaModel:
    """Weights and the step function. `forward` is pure apart from the K/V it writes."""

    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, backend, linears: LinearBuilder | None = None) -> None:
        """`linears` makes the projections and the head (default: dense, as `state` holds them)."""
        self.config = config
        self.shape = ModelShape.from_hf(config)
        self.dtype, self.device, self.backend = dtype, device, backend
        self.small_norm = device.type == "cpu" and dtype == torch.float32 and backend.name == "cpu"
        w = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        make = linears or LinearBuilder("bf16")
        self.lm_head = make.head(w, "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight")
        self.layers = [self._layer(w, i, make) for i in range(self.shape.num_layers)]
        self.inv_freq, self.rope_scaling = rope_inv_freq(config)
        self._cos = self._sin = torch.empty(0, self.shape.head_dim)
        self.scale = self.shape.head_dim ** -0.5

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int, make: LinearBuilder) -> LayerWeights:
        p = f"model.layers.{i}."
        bias = None
        if p + "self_attn.q_proj.bias" in w:
            bias = torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        qkv = make.layer(w, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], bias)
        gate_up = make.layer(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        return LayerWeights(w[p + "input_layernorm.weight"], qkv, make.layer(w, [p + "self_attn.o_proj.weight"]),
                            w[p + "post_attention_layernorm.weight"], gate_up,
                            make.layer(w, [p + "mlp.down_proj.weight"]))

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (num_positions, head_dim) in float32, grown on demand."""
        if self._cos.shape[0] < num_positions:
            n = max(num_positions, 2 * self._cos.shape[0], 4096)
            t = torch.arange(n, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.rope_scaling).to(self.device)
            self._sin = (emb.sin() * self.rope_scaling).to(self.device)
        return self._cos, self._sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.small_norm and x.shape[0] <= cpu.SKINNY_MAX_ROWS:  # a decode step's rows: one C call
            out = cpu.rms_norm(x, weight, self.shape.rms_norm_eps)
            if out is not None:
                return out
        # in float32, then back to the model dtype before the weight (as transformers does)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV],
                logits_idx: torch.Tensor | None,
                block_mass: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids, positions (T,) -> float32 logits (N, vocab) for the rows in logits_idx.

        block_mass (chunks, >= max_blocks) float32, if given, is added every layer's attention
        mass per chunk and table index (see `attention`)."""
        s = self.shape
        widths = [g.block_tables.shape[1] for g in (meta.decode, meta.prefill) if g is not None]
        cos, sin = self.rope_tables(max(widths, default=1) * meta.block_size)  # every cache position
        heads = Heads(s.num_heads, s.num_kv_heads, s.head_dim)
        plan = plan_step(self.backend, meta, positions, cos, sin, self.dtype, heads, block_mass)  # every layer
        h = self.embed[input_ids]  # (T, hidden)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for layer, kv in zip(self.layers, kv_caches):
            x = self.rms_norm(h, layer.input_norm)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, s.num_heads, s.head_dim)  # (T, H, D), rotated per block inside attention
            k = k.view(-1, s.num_kv_heads, s.head_dim)  # (T, KVH, D), stored rotated by its block offset
            v = v.view(-1, s.num_kv_heads, s.head_dim)
            self.backend.write(kv, k, v, plan)
            o = attend(self.backend, q, kv, plan, self.scale)
            h = h + layer.o(o.reshape(-1, q_size))
            x = self.rms_norm(h, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        if logits_idx is None:
            return None
        h = self.rms_norm(h[logits_idx], self.final_norm)
        return self.lm_head(h).float()



def load_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state
