"""Multi-head latent attention (DeepSeek-V2/V3) as one layer of the forward pass.

Owns the layer's weights and its math around the attention backend
(kernels/mla_reference.py has the attention itself and the pool layout):

    x -> q_proj, or q_a_proj -> RMSNorm -> q_b_proj      q (T, H, Dn + R) = [q_nope | q_r]
    x -> kv_a_proj_with_mqa                              [c_raw | k_r] (T, C + R); c = RMSNorm(c_raw)
    [c | k_r] written to the latent pool                 (the backend rotates k_r by its block offset)
    q_c = W_UK_h^T q_nope_h,  q_r * attention_factor^2   the absorbed query (T, H, C + R)
    o_c = attention over the latent                      (T, H, C)
    o_h = W_UV_h o_c,h  ->  o_proj                       (T, H * Dv) -> (T, hidden)

kv_b_proj (H * (Dn + Dv), C) is the key and value up-projection: W_UK (H, Dn, C)
and W_UV (H, Dv, C). It stays dense in the model's dtype under every
--weights format: both halves are used as per-head batched products, never
as one linear layer. q_a_proj and kv_a_proj_with_mqa (or q_proj and
kv_a_proj_with_mqa) read the same x and are fused into one product.

Rotary layout. DeepSeek-V2, and V3 with rope_interleave, rotate interleaved
pairs (x0, x1), (x2, x3), ...; the backends rotate halves (x_i with
x_{i + R/2}). At load the rows of q_r and k_r in the projections are put in
(evens, odds) order, which is the same rotation of the same pairs; a score
sums over the pairs, so none changes. YaRN: the rotation tables are pure
rotations and the rope's attention factor a, which transformers puts on
both cos and sin, goes on q_r as a^2; the softmax scale carries the mscale
of `softmax_scale`. Knows nothing about the pool's layout or the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamchat.model.attention import LatentKV, StepPlan, attend
from streamchat.model.norm import rms_norm
from streamchat.model.qlinear import Linear
from streamchat.model.rope import rope_parameters
from streamchat.model.weights import LinearBuilder

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not rms_norm_eps


@dataclass(frozen=True)
class MLAShape:
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from hidden (DeepSeek-V2-Lite)
    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # R
    v_head_dim: int  # Dv

    @classmethod
    def from_hf(cls, config) -> MLAShape:
        return cls(config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
                   config.qk_rope_head_dim, config.v_head_dim)


def softmax_scale(config, shape: MLAShape) -> float:
    """(Dn + R)^-0.5, times mscale^2 under YaRN with mscale_all_dim (0.1 mscale_all_dim ln(factor) + 1)."""
    scale = (shape.qk_nope_head_dim + shape.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(w: torch.Tensor, start: int, rope_dim: int, period: int) -> torch.Tensor:
    """Rows start .. start + rope_dim of every `period` rows of w (or a bias) in (evens, odds) order."""
    perm = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    index = torch.arange(w.shape[0]).view(-1, period)  # (groups, period)
    index[:, start:start + rope_dim] = index[:, start:start + rope_dim][:, perm]
    return w[index.reshape(-1).to(w.device)]


def to_rotate_half(w: dict[str, torch.Tensor], prefix: str, s: MLAShape) -> None:
    """Put the rows that make q_r and k_r (q_proj or q_b_proj; kv_a_proj_with_mqa and its bias) in
    (evens, odds) order, in `w`."""
    q_name = prefix + ("q_b_proj" if s.q_lora_rank else "q_proj") + ".weight"
    w[q_name] = deinterleave(w[q_name], s.qk_nope_head_dim, s.qk_rope_head_dim, s.qk_nope_head_dim + s.qk_rope_head_dim)
    for name in (prefix + "kv_a_proj_with_mqa.weight", prefix + "kv_a_proj_with_mqa.bias"):
        if name in w:
            w[name] = deinterleave(w[name], s.kv_lora_rank, s.qk_rope_head_dim, w[name].shape[0])


def fused_bias(w: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    """The biases of projections fused along out_features (zeros for one without), or None if none has one."""
    biases = [w.get(n + ".bias") for n in names]
    if all(b is None for b in biases):
        return None
    return torch.cat([w[n + ".weight"].new_zeros(w[n + ".weight"].shape[0]) if b is None else b
                      for n, b in zip(names, biases)])


class MLA:
    """One layer's latent attention: `__call__(x, kv, plan)` writes the tokens' latents and returns
    the layer's output (T, hidden)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, shape: MLAShape, make: LinearBuilder,
                 backend, interleaved: bool, rope_factor: float, scale: float) -> None:
        """prefix "model.layers.N.self_attn."; `interleaved`: the checkpoint rotates pairs (see above)."""
        s = self.shape = shape
        self.backend, self.scale = backend, scale
        self.rope_gain = rope_factor * rope_factor  # transformers' factor on cos and sin, on q_r alone
        if interleaved:
            to_rotate_half(w, prefix, s)
        # hidden -> [q (or q_a) | c_raw | k_r]: one product for both projections of x
        first = [prefix + ("q_a_proj" if s.q_lora_rank else "q_proj"), prefix + "kv_a_proj_with_mqa"]
        self.qkv_a = make.layer(w, [n + ".weight" for n in first], fused_bias(w, first))
        self.q_width = w[first[0] + ".weight"].shape[0]
        self.q_a_norm = w.get(prefix + "q_a_layernorm.weight")
        self.q_b: Linear | None = make.layer(w, [prefix + "q_b_proj.weight"]) if s.q_lora_rank else None
        self.kv_a_norm = w[prefix + "kv_a_layernorm.weight"]
        up = w[prefix + "kv_b_proj.weight"].view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        self.w_uk = up[:, :s.qk_nope_head_dim].contiguous()  # (H, Dn, C)
        self.w_uv_t = up[:, s.qk_nope_head_dim:].transpose(1, 2).contiguous()  # (H, C, Dv)
        self.o = make.layer(w, [prefix + "o_proj.weight"])

    def __call__(self, x: torch.Tensor, kv: LatentKV, plan: StepPlan) -> torch.Tensor:
        s = self.shape
        q, latent = self.qkv_a(x).split([self.q_width, s.kv_lora_rank + s.qk_rope_head_dim], dim=-1)
        if self.q_b is not None:
            q = self.q_b(rms_norm(q, self.q_a_norm, LATENT_NORM_EPS))
        c = rms_norm(latent[:, :s.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        self.backend.write_latent(kv, torch.cat((c, latent[:, s.kv_lora_rank:]), dim=-1), plan)
        q = q.view(-1, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim)  # (T, H, Dn + R)
        q_c = torch.bmm(q[..., :s.qk_nope_head_dim].transpose(0, 1), self.w_uk)  # (H, T, C)
        q_abs = torch.cat((q_c.transpose(0, 1), q[..., s.qk_nope_head_dim:] * self.rope_gain), dim=-1)
        o_c = attend(self.backend, q_abs, kv, plan, self.scale)  # (T, H, C)
        o = torch.bmm(o_c.transpose(0, 1), self.w_uv_t)  # (H, T, Dv)
        return self.o(o.transpose(0, 1).reshape(len(x), s.num_heads * s.v_head_dim))
