"""The feed-forward blocks of DeepSeek-V2/V3: gated MLPs, and mixture-of-experts layers that route
each token to its top-k experts and add the shared experts.

Owns routing and the expert loop as transformers' DeepseekV2/V3 compute them
(the oracle):

    deepseek_v2  scores = softmax(x W_gate^T) in float32; `greedy`: the top k; `group_limited_greedy`:
                 the top k among the topk_group groups with the highest single score; weights =
                 the chosen scores * routed_scaling_factor (transformers' V2 never renormalizes)
    deepseek_v3  scores = sigmoid(x W_gate^T); choice = scores + e_score_correction_bias; groups ranked
                 by the sum of their two best choices, the top k of the topk_group best groups;
                 weights = the chosen scores, divided by their sum when norm_topk_prob, times
                 routed_scaling_factor

    out = sum over chosen experts e of weight_e * expert_e(x)  +  shared(x)

Straightforward by design (correctness first): per step, every expert that
at least one token chose runs once on its tokens (a gather, three products,
an index_add). A decode step of B sessions reads up to min(E, B * k) experts'
weights: at batch 16 nearly all of them. Knows nothing about attention or
the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamchat.config import ConfigError
from streamchat.model.qlinear import Linear
from streamchat.model.weights import LinearBuilder


class GatedMLP:
    """down(silu(gate(x)) * up(x)), gate and up fused into one product."""

    def __init__(self, gate_up: Linear, down: Linear) -> None:
        self.gate_up, self.down = gate_up, down

    @classmethod
    def load(cls, w: dict[str, torch.Tensor], prefix: str, make: LinearBuilder) -> GatedMLP:
        return cls(make.layer(w, [prefix + "gate_proj.weight", prefix + "up_proj.weight"]),
                   make.layer(w, [prefix + "down_proj.weight"]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Router:
    """Top-k expert choice per token: (weights (T, k) float32, experts (T, k) int64)."""

    def __init__(self, config, weight: torch.Tensor, bias: torch.Tensor | None, sigmoid: bool) -> None:
        self.weight = weight.float()  # (E, hidden): transformers keeps the gate in float32
        self.bias = None if bias is None else bias.float()  # (E,) e_score_correction_bias (V3)
        self.sigmoid = sigmoid
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.method = "sigmoid_groups" if sigmoid else (getattr(config, "topk_method", None) or "greedy")
        if self.method not in ("greedy", "group_limited_greedy", "sigmoid_groups"):
            raise ConfigError(f"unsupported MoE topk_method {self.method!r}; this runner routes greedy and "
                              f"group_limited_greedy (deepseek_v2) and grouped sigmoid (deepseek_v3)")
        self.num_groups, self.topk_groups = config.n_group or 1, config.topk_group or 1
        self.norm = bool(getattr(config, "norm_topk_prob", False)) and sigmoid

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # (T, E)
        if not self.sigmoid:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                scores = scores.masked_fill(~self._group_mask(scores.view(len(x), self.num_groups, -1).amax(-1)), 0.0)
            weights, experts = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.bias
            groups = choice.view(len(x), self.num_groups, -1).topk(2, dim=-1)[0].sum(-1)  # (T, groups)
            choice = choice.masked_fill(~self._group_mask(groups), float("-inf"))
            experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
            if self.norm:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """(T, groups) -> (T, E) bool: the experts of each token's topk_group best groups."""
        best = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        per_group = self.weight.shape[0] // self.num_groups
        return mask[:, :, None].expand(-1, -1, per_group).reshape(len(group_scores), -1)


class MoE:
    """Routed experts plus the shared experts (one gated MLP of n_shared_experts x the expert width)."""

    def __init__(self, router: Router, experts: list[GatedMLP], shared: GatedMLP | None) -> None:
        self.router, self.experts, self.shared = router, experts, shared

    @classmethod
    def load(cls, config, w: dict[str, torch.Tensor], routers: dict[str, torch.Tensor], prefix: str,
             make: LinearBuilder, sigmoid: bool) -> MoE:
        """prefix "model.layers.N.mlp."; `routers` holds the gates' weights in float32, as stored."""
        split_experts(w, prefix, config.n_routed_experts)
        bias = routers.get(prefix + "gate.e_score_correction_bias") if sigmoid else None
        router = Router(config, routers[prefix + "gate.weight"], bias, sigmoid)
        experts = [GatedMLP.load(w, f"{prefix}experts.{e}.", make) for e in range(config.n_routed_experts)]
        shared = GatedMLP.load(w, prefix + "shared_experts.", make) if config.n_shared_experts else None
        return cls(router, experts, shared)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x)  # (T, k) each
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending, as transformers visits them
            tokens, slot = torch.where(chosen == e)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out if self.shared is None else out + self.shared(x)


def split_experts(w: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Experts as transformers 5 holds them in memory (experts.gate_up_proj (E, 2I, hidden),
    experts.down_proj (E, hidden, I)) become the per-expert names checkpoints store
    (experts.{e}.gate_proj.weight, ...); per-expert entries are left as they are."""
    fused = w.pop(prefix + "experts.gate_up_proj", None)
    if fused is None:
        return
    down = w.pop(prefix + "experts.down_proj")
    gate, up = fused.chunk(2, dim=1)
    for e in range(num_experts):
        w[f"{prefix}experts.{e}.gate_proj.weight"] = gate[e]
        w[f"{prefix}experts.{e}.up_proj.weight"] = up[e]
        w[f"{prefix}experts.{e}.down_proj.weight"] = down[e]
