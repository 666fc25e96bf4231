"""Pure-torch paged attention: the CPU backend and the oracle the Triton kernels must match.

Layouts (every function here shares them with its kernel in this package):

    key_cache, value_cache : (num_blocks, block_size, num_kv_heads, head_dim)
                             keys stored BEFORE rotary embedding
    block_tables           : (num_seqs, max_blocks) int32, padded with block 0
    seq_lens               : (num_seqs,) int32, tokens in the cache per sequence,
                             the ones written this step included
    cos, sin               : (max_pos, head_dim) float32, rotate-half layout
                             (the halves repeat), indexed by cache position
    k_scale, v_scale       : None for an unquantized pool; else its scales (see quant.py)

A key at table index i, offset o has cache position p = i * block_size + o
and is rotated by p when attended: positions are cache positions, so
evicting a block moves no data. Queries arrive already rotated.

Oracles never mutate their inputs (write_kv is the one write, by design).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamchat.kernels import quant


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., L, heads, D) by per-position cos/sin (L, D), in x's dtype.

    x * cos, then each half takes its rotated partner times sin in place
    (out1 -= x2 s, out2 += x1 s; the tables repeat their halves): three
    passes over x instead of the five of `x * cos + rotate_half(x) * sin`.
    The tables are expanded over the heads first: a broadcast inner dimension
    makes these products about twice as slow on CPU.
    """
    length, heads, dim = x.shape[-3:]
    half = dim // 2
    c = cos[:, None, :].to(x.dtype).expand(length, heads, dim).contiguous()
    s = sin[:, None, :half].to(x.dtype).expand(length, heads, half).contiguous()
    out = x * c
    out[..., :half].addcmul_(x[..., half:], s, value=-1)
    out[..., half:].addcmul_(x[..., :half], s)
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, ...) -> (num_blocks * block_size, ...)."""
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter key/value (T, num_kv_heads, head_dim) into their slots (T,) of the pool.

    A quantized pool (scales given) stores them in its format (see quant.py).
    """
    if k_scale is None:
        _flat(key_cache)[slot_mapping] = key
        _flat(value_cache)[slot_mapping] = value
        return
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        stored, scales = quant.quantize(x, cache.dtype)
        _flat(cache)[slot_mapping] = stored
        _flat(scale)[slot_mapping] = scales


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (rotated by cache position) and values of padded tables: (B, L, KVH, D) each."""
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    length = max_blocks * block_size
    idx = block_tables.reshape(-1).long()  # index_select: ~5x faster than advanced indexing on CPU
    k = key_cache.index_select(0, idx).view(num_seqs, length, num_kv_heads, -1)
    v = value_cache.index_select(0, idx).view(num_seqs, length, num_kv_heads, -1)
    if k_scale is not None:
        ks = k_scale.index_select(0, idx).view(num_seqs, length, *k_scale.shape[2:])
        vs = v_scale.index_select(0, idx).view(num_seqs, length, *v_scale.shape[2:])
        k, v = quant.dequantize(k, ks, dtype), quant.dequantize(v, vs, dtype)
    return apply_rope(k, cos[:length], sin[:length]), v


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q (B, H, D) -> out (B, H, D).

    Grouped-query heads share their KV head: q is viewed as (B, KVH, G, D) so
    each KV head is read once for its whole group.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    k, v = gather_kv(key_cache, value_cache, block_tables, cos, sin, k_scale, v_scale, q.dtype)  # (B, L, KVH, D)
    length = k.shape[1]
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None].long()  # (B, L)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)  # (B, KVH, G, D)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
    )  # (B, KVH, G, D)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen chunks: q (T, H, D), sequence b's queries at q[cu[b]:cu[b+1]] -> out (T, H, D).

    Query i of a chunk of n sits at cache position seq_len - n + i and attends,
    causally, to every cached key at or before it (earlier blocks + the chunk).
    Grouped-query heads share their KV head (`enable_gqa`): keys are never
    repeated per head.
    """
    block_size = key_cache.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, kv_len in enumerate(lens):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        if n == 0:
            continue
        num_blocks = -(-kv_len // block_size)
        k, v = gather_kv(key_cache, value_cache, block_tables[b:b + 1, :num_blocks], cos, sin,
                         k_scale, v_scale, q.dtype)
        k, v = k[:, :kv_len].transpose(1, 2), v[:, :kv_len].transpose(1, 2)  # (1, KVH, L, D)
        qb = q[start:end].transpose(0, 1)[None]  # (1, H, n, D)
        if n == kv_len:  # nothing cached before the chunk: plain causal
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # (n, L)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)  # (n, H, D)
    return out
