"""KV write: scatter this step's keys and values into their slots of one layer's pool, keys rotated by offset.

Computes what `reference.write_kv` computes, in one launch for K and V:

    o = slot % block_size
    key_cache[slot // block_size, o]   = rope(key[t], o)     for t, slot in enumerate(slot_mapping)
    value_cache[...]                   = value[t]

The key is rotated by its offset in its block (never by its cache
position), in float32, and then stored: so a block's bytes depend on its
tokens alone, wherever it sits in a table. For an int8/fp8 pool it
quantizes on the way in, after the rotation, with one scale per token per
KV head: scale = max|x| / Q_MAX (1 where x is all zero), stored x / scale
rounded (int8: half away from zero, clamped to +-127; fp8: the
conversion's rounding) and the scale beside it, so that a reader's
x.to(float32) * scale is within half a step of x.

Grid (T,): a program moves one token, all its KV heads, K and V.

Layouts:

    key, value     : (T, num_kv_heads, head_dim), unrotated, last dim contiguous (views
                     of the fused qkv projection are fine)
    slot_mapping   : (T,) int64 (or int32), slot = block_id * block_size + offset
    cos, sin       : (max_pos, head_dim) float32, rows 0 .. block_size-1 read
    key_cache...   : see paged_attention.py; k_scale/v_scale written when given

The slot's block id is multiplied by the pool's block stride in int64.
Scalar loads indexed by the program id are in range by the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamchat.kernels.paged_attention import QUANT_STORAGE, check_pool, check_rope, scale_strides, slot_rows

Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def quantize(x, amax, Q_MAX: tl.constexpr, ROUND: tl.constexpr):
    """x (KVH_PAD, C) float32 and its per-head max |x| (KVH_PAD,) -> (values to store, scales).

    Both divisions round to nearest (div_rn): a GPU's default float32 `/` is
    approximate (div.full, 2 ulp), and an int8 code sitting on a .5 boundary
    would then differ from the reference's IEEE division.
    """
    scale = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, Q_MAX, tl.float32)), 1.0)
    y = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    if ROUND:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return tl.minimum(tl.maximum(y, -Q_MAX), Q_MAX), scale


@triton.jit
def store_values(src_ptr, dst_ptr, scale_ptr, src, dst, scale_dst, mask, head_mask,
                 QUANT: tl.constexpr, Q_MAX: tl.constexpr, ROUND: tl.constexpr):
    """Copy a (KVH_PAD, D_PAD) tile of one token, quantizing per head when QUANT."""
    x = tl.load(src_ptr + src, mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        y, scale = quantize(x, tl.max(tl.abs(x), axis=1), Q_MAX, ROUND)
        tl.store(dst_ptr + dst, y.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_dst, scale, mask=head_mask)
    else:
        tl.store(dst_ptr + dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_keys(src_ptr, dst_ptr, scale_ptr, cos_ptr, sin_ptr, src, dst, scale_dst, offset, stride_cos,
               mask, head_mask, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
               QUANT: tl.constexpr, Q_MAX: tl.constexpr, ROUND: tl.constexpr):
    """Rotate a (KVH_PAD, 2 x HALF_PAD) tile of one token's key halves by its block offset (float32),
    then store it, quantizing per head (over both halves) when QUANT. src, dst: first-half offsets."""
    dh = tl.arange(0, HALF_PAD)
    x1 = tl.load(src_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
    rope = offset * stride_cos + dh
    c = tl.load(cos_ptr + rope, mask=dh < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + rope, mask=dh < HALF, other=0.0)[None, :]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))
        y1, scale = quantize(y1, amax, Q_MAX, ROUND)
        y2, scale = quantize(y2, amax, Q_MAX, ROUND)
        tl.store(scale_ptr + scale_dst, scale, mask=head_mask)
    tl.store(dst_ptr + dst, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + dst + HALF, y2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, cos_ptr, sin_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_block, stride_offset, stride_head, stride_scale_block, stride_scale_offset, stride_scale_head,
    stride_cos,
    NUM_KV_HEADS: tl.constexpr, KVH_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, Q_MAX: tl.constexpr, ROUND: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    dh = tl.arange(0, HALF_PAD)
    head_mask = h < NUM_KV_HEADS
    rows = slot_rows(block_id, offset, h, stride_block, stride_offset, stride_head)  # (KVH_PAD,)
    scale_dst = slot_rows(block_id, offset, h, stride_scale_block, stride_scale_offset, stride_scale_head)
    half_mask = head_mask[:, None] & (dh < HALF)[None, :]
    store_keys(key_ptr, key_cache_ptr, k_scale_ptr, cos_ptr, sin_ptr,
               tok * stride_key_tok + h[:, None] * stride_key_head + dh[None, :], rows[:, None] + dh[None, :],
               scale_dst, offset, stride_cos, half_mask, head_mask, HALF, HALF_PAD, QUANT, Q_MAX, ROUND)
    store_values(value_ptr, value_cache_ptr, v_scale_ptr,
                 tok * stride_value_tok + h[:, None] * stride_value_head + d[None, :], rows[:, None] + d[None, :],
                 scale_dst, head_mask[:, None] & (d < HEAD_DIM)[None, :], head_mask, QUANT, Q_MAX, ROUND)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """`reference.write_kv`, one launch: keys rotated by block offset; quantizes into int8/fp8 pools."""
    check_pool(key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_rope(cos, sin, head_dim)
    assert cos.shape[0] >= key_cache.shape[1], "the rope tables must cover every offset in a block"
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and value.shape == key.shape
    assert key.dtype == value.dtype and key.stride(2) == 1 and value.stride(2) == 1
    assert slot_mapping.dtype in (torch.int64, torch.int32) and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    quant = key_cache.dtype in QUANT_STORAGE
    half = head_dim // 2
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, cos, sin,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *scale_strides(k_scale), cos.stride(0),
        NUM_KV_HEADS=num_kv_heads, KVH_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        BLOCK_SIZE=key_cache.shape[1], QUANT=quant,
        Q_MAX=Q_MAX.get(key_cache.dtype, 0.0), ROUND=key_cache.dtype == torch.int8, num_warps=4)
