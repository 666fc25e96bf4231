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

from streamchat.kernels import cpu_forward
from streamchat.model.attention import AttentionMetadata, Heads, LayerKV, attend
from streamchat.model.decoder import DecoderModel
from streamchat.model.kv_spec import FullAttentionSpec
from streamchat.model.qlinear import DenseLinear, Linear
from streamchat.model.rope import RopeTables, inv_freq
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


class LlamaModel(DecoderModel):
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
        inv, factor = inv_freq(config, self.shape.head_dim)
        # transformers puts the rope's attention factor (YaRN's; 1 for the other types here) on both cos
        # and sin, so a score carries it squared. Pure rotations keep the keys' stored rotation and the
        # prefill's rotation by block start composable (with the factor in the tables a prefill score took it
        # cubed); the softmax scale takes the square instead.
        self.rope = RopeTables(inv, 1.0, device)
        self.scale = self.shape.head_dim ** -0.5 * factor * factor
        self.stack = self._stack()

    def _stack(self) -> "cpu_forward.DecodeStack | None":
        """The layers for one C call a decode step (`cpu_forward`), on the CPU backend when every projection
        multiplies a step's few rows in groups (the GGUF's blocks) without a bias: up to 32 rows of a float32
        model, up to BF16_GROUP_ROWS of a bfloat16 one (whose larger batches take oneDNN's bf16 GEMM, and
        whose few rows the stack then runs in float32 throughout); None otherwise."""
        if (self.backend.name != "cpu" or self.device.type != "cpu" or not self.layers
                or not cpu_forward.DecodeStack.usable()):
            return None
        parts, rows = [], cpu_forward.MAX_ROWS
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(isinstance(lin, DenseLinear) and lin.groups is not None and lin.few_rows > 0
                       for lin in linears):
                return None
            rows = min([rows] + [lin.few_rows for lin in linears])
            parts.append(cpu_forward.LayerWeights(layer.input_norm.float().contiguous(),
                                                  layer.post_norm.float().contiguous(),
                                                  *(lin.groups for lin in linears)))
        s = self.shape
        first = self.layers[0]
        x8 = cpu_forward.x8_mask(first.qkv.x8, first.o.x8, first.gate_up.x8, first.down.x8)
        return cpu_forward.DecodeStack(parts, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                       first.down.groups.k, s.rms_norm_eps, self.scale, x8, rows)

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

    def kv_specs(self, block_size: int, kv_dtype: str) -> list[FullAttentionSpec]:
        """Each layer's cache: keys and values per KV head."""
        s = self.shape
        return [FullAttentionSpec(block_size, s.num_kv_heads, s.head_dim, self.dtype, kv_dtype)] * s.num_layers

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV],
                logits_idx: torch.Tensor | None,
                block_mass: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids, positions (T,) -> float32 logits (N, vocab) for the rows in logits_idx.

        block_mass (chunks, >= max_blocks) float32, if given, is added every layer's attention
        mass per chunk and table index (see `attention`)."""
        s = self.shape
        d = meta.decode
        if self.stack is not None and meta.prefill is None and d is not None and block_mass is None:
            h = self.embed[input_ids].float()  # (T, hidden), a new tensor the stack runs the layers over in place
            cos, sin = self.rope_tables(d.block_tables.shape[1] * meta.block_size)
            if self.stack.run(h, kv_caches, meta.slot_mapping, d.block_tables, d.seq_lens, cos, sin, meta.block_size):
                return self.logits(h.to(self.dtype), logits_idx)
        plan = self.step_plan(meta, positions, Heads(s.num_heads, s.num_kv_heads, s.head_dim), block_mass)
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
        return self.logits(h, logits_idx)



def load_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state
