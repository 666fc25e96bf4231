"""Paged multi-head latent attention (MLA) in pure torch: the oracle and the torch/CPU backend's path.

DeepSeek-V2/V3 cache one latent row per token and layer instead of keys and
values per head (shapes of DeepSeek-V2-Lite in brackets):

    latent_cache : (num_blocks, block_size, C + R)  [C = kv_lora_rank 512, R = qk_rope_head_dim 64]
                   row = [ c | R(o) k_r ]: c the normalized compressed KV, k_r the rotary key all
                   heads share, stored rotated by its OFFSET o in its block (slot % block_size)
    latent_scale : None, or int8/fp8 (num_blocks, block_size, 2) float32 (c's scale, k_r's);
                   int4 (num_blocks, block_size, (C + R) // 32, 2) float16 (see quant.py)
    q            : (T, H, C + R) absorbed queries: q_c = W_UK_h^T q_nope_h per head, then q_r
                   (the rotary part, unrotated, times the rope's attention factor squared)
    out          : (T, H, C) attention over c; the caller applies W_UV_h per head
    cos, sin     : (max_pos, R) float32 rotate-half tables, pure rotations
    block tables, seq_lens, plans: those of reference.py with ONE KV head (Heads(H, 1, .))

Absorbed form: head h's key for token j is [W_UK_h c_j | k_r,j] and its value
W_UV_h c_j, so

    score = q_nope . W_UK c + q_r . k_r = [q_c | q_r] . [c | k_r],   out_h = W_UV_h sum_j p_j c_j

which is multi-query attention with C + R wide keys and the keys' first C
values as values: decode and prefill read nothing but the latent, and no
per-head key or value is ever formed. Positions as in reference.py: the
query's rotary part is rotated per block by (query position - block start)
in decode; in prefill the queries by position and each gathered block's
rotary keys by its block start. A block's bytes depend on its tokens alone.

Attention mass per block (h2o) is added to `block_mass` summed over the H
heads and the chunk's queries, as reference.py does. Oracles never mutate
their inputs (write_latent is the one write, by design).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamchat.kernels import quant
from streamchat.kernels.reference import (DecodePlan, PrefillPlan, Workspace, attention_with_mass, decode_plan,
                                          prefill_plan, rope_rows, rotate, scratch)


def write_latent(latent_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, latent_scale: torch.Tensor | None = None) -> None:
    """Scatter latent rows (T, C + R), unrotated, into their slots (T,): the rotary part rotated by
    the slot's offset in its block, in float32, then cast or quantized into the pool."""
    c, s = rope_rows(cos, sin, slot_mapping % latent_cache.shape[1], torch.float32)
    store_latent(latent_cache, latent, slot_mapping, c, s, latent_scale)


def store_latent(latent_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor,
                 rope_cos: torch.Tensor, rope_sin: torch.Tensor, latent_scale: torch.Tensor | None = None) -> None:
    """`write_latent` with the float32 rotation rows given: (T, R) and (T, R // 2)."""
    rope_dim = rope_cos.shape[-1]
    x = latent.float()  # (T, C + R), a copy when latent is not float32 already
    x = torch.cat((x[:, :-rope_dim], rotate(x[:, -rope_dim:], rope_cos, rope_sin)), dim=-1)
    flat = latent_cache.view(-1, latent_cache.shape[-1])  # (num_blocks * block_size, width)
    if latent_scale is None:
        flat[slot_mapping] = x.to(latent_cache.dtype)
        return
    stored, scales = quant.quantize_latent(x, latent_cache.dtype, x.shape[-1] - rope_dim)
    flat[slot_mapping] = stored
    latent_scale.view(-1, *latent_scale.shape[2:])[slot_mapping] = scales


def gather_rows(latent_cache: torch.Tensor, latent_scale: torch.Tensor | None, rows: torch.Tensor,
                latent_dim: int, dtype: torch.dtype, workspace: Workspace | None = None) -> torch.Tensor:
    """Latent rows (pool slots) `rows` (N,) int64, dequantized to `dtype`: (N, C + R)."""
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    x = torch.index_select(flat, 0, rows, out=scratch(workspace, "latent", (rows.shape[0], flat.shape[1]),
                                                       flat.dtype, flat.device))
    if latent_scale is None:
        return x
    scales = latent_scale.view(-1, *latent_scale.shape[2:]).index_select(0, rows)
    return quant.dequantize_latent(x, scales, latent_dim, dtype)


def block_rows(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of blocks (N,), in table order: (N * block_size,) int64."""
    return (block_ids.long()[:, None] * block_size + torch.arange(block_size, device=block_ids.device)).reshape(-1)


# ---- decode -----------------------------------------------------------------------------------


def paged_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                     latent_scale: torch.Tensor | None = None,
                     block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """One absorbed query per sequence at position seq_lens[b] - 1: q (B, H, C + R) -> out (B, H, C)."""
    plan = decode_plan(block_tables, seq_lens, latent_cache.shape[1], q.shape[1], 1, cos, sin, q.dtype)
    return decode(q, latent_cache, plan, scale, latent_scale, block_mass)


def decode(q: torch.Tensor, latent_cache: torch.Tensor, plan: DecodePlan, scale: float,
           latent_scale: torch.Tensor | None = None, block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_mla_decode` on a reference decode plan made for one KV head."""
    num_seqs, num_heads, width = q.shape
    max_blocks, rope_dim = plan.q_cos.shape[2], plan.q_cos.shape[-1]
    latent_dim, block_size = width - rope_dim, latent_cache.shape[1]
    length = max_blocks * block_size
    kv = gather_rows(latent_cache, latent_scale, plan.rows, latent_dim, q.dtype, plan.workspace)
    kv = kv.view(num_seqs, length, width)  # (B, L, C + R), table order
    q_r = rotate(q[:, None, None, :, latent_dim:], plan.q_cos, plan.q_sin)  # (B, 1, NB, H, R): per block
    s = torch.bmm(q[..., :latent_dim], kv[..., :latent_dim].transpose(1, 2))  # (B, H, L): q_c . c
    s_r = torch.bmm(q_r.view(-1, num_heads, rope_dim),  # (B * NB, H, bs): q_r . k_r, block by block
                    kv.view(-1, block_size, width)[..., latent_dim:].transpose(1, 2))
    s += s_r.view(num_seqs, max_blocks, num_heads, block_size).transpose(1, 2).reshape(num_seqs, num_heads, length)
    probs = s.mul_(scale).masked_fill_(~plan.mask[:, 0], float("-inf")).softmax(-1, dtype=torch.float32)
    if block_mass is not None:  # (B, H, NB * bs) -> (B, NB)
        block_mass[:, :max_blocks] += probs.view(num_seqs, num_heads, max_blocks, block_size).sum((1, 3))
    return torch.bmm(probs.to(q.dtype), kv[..., :latent_dim])  # (B, H, C)


# ---- prefill ----------------------------------------------------------------------------------


def paged_mla_prefill(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      scale: float, latent_scale: torch.Tensor | None = None,
                      block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen chunks of absorbed queries, sequence b's at q[cu[b]:cu[b+1]], causal: (T, H, C + R) -> (T, H, C)."""
    query_lens = cu_seqlens_q.diff().tolist()  # the oracle may sync; a backend's plan comes from host lists
    key_lens = seq_lens.tolist()
    positions = torch.cat([torch.arange(k - n, k) for n, k in zip(query_lens, key_lens)]).to(q.device)
    plan = prefill_plan(block_tables, query_lens, key_lens, positions, latent_cache.shape[1], q.shape[1], 1,
                        cos, sin, q.dtype)
    return prefill(q, latent_cache, plan, scale, latent_scale, block_mass)


def prefill(q: torch.Tensor, latent_cache: torch.Tensor, plan: PrefillPlan, scale: float,
            latent_scale: torch.Tensor | None = None, block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_mla_prefill` on a reference prefill plan made for one KV head: the chunk's queries
    rotated by position, each gathered block's rotary keys by its block start."""
    num_heads, width = q.shape[1:]
    rope_dim = plan.q_cos.shape[-1]
    latent_dim, block_size = width - rope_dim, latent_cache.shape[1]
    q = torch.cat((q[..., :latent_dim], rotate(q[..., latent_dim:], plan.q_cos, plan.q_sin)), dim=-1)
    out = q.new_empty(q.shape[0], num_heads, latent_dim)
    for seq in plan.seqs:
        length = seq.num_keys
        kv = gather_rows(latent_cache, latent_scale, block_rows(seq.block_ids, block_size), latent_dim, q.dtype,
                         plan.workspace)[:length]  # (L, C + R) as stored
        k_r = rotate(kv[:, latent_dim:], plan.k_cos[:length, 0], plan.k_sin[:length, 0])  # by cache position
        k = torch.cat((kv[:, :latent_dim], k_r), dim=-1)[None, None]  # (1, 1, L, C + R)
        v = kv[:, :latent_dim][None, None]  # (1, 1, L, C)
        qb = q[seq.start:seq.end].transpose(0, 1)[None]  # (1, H, n, C + R)
        if block_mass is None:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=seq.mask, is_causal=seq.mask is None,
                                               scale=scale, enable_gqa=True)
        else:
            o, mass = attention_with_mass(qb, k, v, scale, block_size)
            block_mass[seq.index, :mass.shape[0]] += mass
        out[seq.start:seq.end] = o[0].transpose(0, 1)  # (n, H, C)
    return out
