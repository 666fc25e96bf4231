"""Our own forward pass for DeepSeek-V2 and V3 (`deepseek_v2`, `deepseek_v3`) over a flat varlen batch.

Owns the model around its layers: the embedding, each layer's RMSNorms and
residuals, multi-head latent attention (`mla`) over a latent pool of one
row per token, the first `first_k_dense_replace` layers' gated MLPs and the
mixture-of-experts layers after them (`moe`), the final norm and the head;
and the layers' KV specs (`MLAAttentionSpec`: kv_lora_rank + qk_rope_head_dim
values a token). The same interface as `LlamaModel` (shape, kv_specs,
rope_tables, forward), so the runner, the engine and the tiers need no
kind. Knows nothing about scheduling, sessions or block bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamchat.model.attention import AttentionMetadata, Heads, LatentKV
from streamchat.model.decoder import DecoderModel
from streamchat.model.kv_spec import MLAAttentionSpec
from streamchat.model.mla import MLA, MLAShape, softmax_scale
from streamchat.model.moe import MoE, GatedMLP
from streamchat.model.rope import RopeTables, inv_freq
from streamchat.model.weights import LinearBuilder


@dataclass(frozen=True)
class DeepseekShape:
    """The figures the rest of the daemon reads (as `llama.ModelShape`), and the attention's own."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    attention: MLAShape

    @classmethod
    def from_hf(cls, config) -> DeepseekShape:
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size,
                   config.rms_norm_eps, config.max_position_embeddings, MLAShape.from_hf(config))


@dataclass
class DeepseekLayer:
    input_norm: torch.Tensor
    attention: MLA
    post_norm: torch.Tensor
    mlp: GatedMLP | MoE


class DeepseekModel(DecoderModel):
    """Weights and the step function. `forward` is pure apart from the latents it writes."""

    captures_graphs = False  # MoE routing reads the chosen experts on the host: a sync no graph can hold

    def __init__(self, config, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, backend, linears: LinearBuilder | None = None) -> None:
        """`linears` makes the projections, the experts and the head (default: dense, as `state` holds them)."""
        self.config = config
        self.shape = s = DeepseekShape.from_hf(config)
        self.dtype, self.device, self.backend = dtype, device, backend
        self.small_norm = device.type == "cpu" and dtype == torch.float32 and backend.name == "cpu"
        self.v3 = config.model_type == "deepseek_v3"
        w = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        routers = {k: v.to(device) for k, v in state.items() if ".mlp.gate." in k}  # float32, as stored
        self.embed = w["model.embed_tokens.weight"]
        self.final_norm = w["model.norm.weight"]
        make = linears or LinearBuilder("bf16")
        self.lm_head = make.head(w, "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight")
        inv, rope_factor = inv_freq(config, s.attention.qk_rope_head_dim)
        self.rope = RopeTables(inv, 1.0, device)  # pure rotations: the attention factor goes on q_r (mla)
        interleaved = not self.v3 or getattr(config, "rope_interleave", True)
        scale = softmax_scale(config, s.attention)
        self.layers = [self._layer(w, routers, i, make, interleaved, rope_factor, scale) for i in range(s.num_layers)]

    def _layer(self, w, routers, i: int, make: LinearBuilder, interleaved: bool, rope_factor: float,
               scale: float) -> DeepseekLayer:
        p = f"model.layers.{i}."
        attention = MLA(w, p + "self_attn.", self.shape.attention, make, self.backend, interleaved, rope_factor,
                        scale)
        if i >= self.config.first_k_dense_replace and self.config.n_routed_experts:
            mlp = MoE.load(self.config, w, routers, p + "mlp.", make, sigmoid=self.v3)
        else:
            mlp = GatedMLP.load(w, p + "mlp.", make)
        return DeepseekLayer(w[p + "input_layernorm.weight"], attention, w[p + "post_attention_layernorm.weight"], mlp)

    def kv_specs(self, block_size: int, kv_dtype: str) -> list[MLAAttentionSpec]:
        a = self.shape.attention
        spec = MLAAttentionSpec(block_size, a.kv_lora_rank, a.qk_rope_head_dim, self.dtype, kv_dtype)
        return [spec] * self.shape.num_layers

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LatentKV], logits_idx: torch.Tensor | None,
                block_mass: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids, positions (T,) -> float32 logits (N, vocab) for the rows in logits_idx.

        block_mass (chunks, >= max_blocks) float32, if given, is added every layer's attention
        mass per chunk and table index, summed over the heads."""
        s = self.shape
        heads = Heads(s.num_heads, 1, s.attention.kv_lora_rank)  # all heads read one latent row a token
        plan = self.step_plan(meta, positions, heads, block_mass)  # every layer's
        h = self.embed[input_ids]  # (T, hidden)
        for layer, kv in zip(self.layers, kv_caches):
            h = h + layer.attention(self.rms_norm(h, layer.input_norm), kv, plan)
            h = h + layer.mlp(self.rms_norm(h, layer.post_norm))
        return self.logits(h, logits_idx)
