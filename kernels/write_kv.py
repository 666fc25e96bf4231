"""KV write: scatter this step's keys (before rotation) and values into their slots of one layer's pool.

Computes what `reference.write_kv` computes, in one launch for K and V:

    key_cache[slot // block_size, slot % block_size] = key[t]     for t, slot in enumerate(slot_mapping)
    value_cache[...]                                   = value[t]

and, for an int8/fp8 pool, quantizes on the way in with one scale per token
per KV head: scale = max|x| / Q_MAX (1 where x is all zero), stored
x / scale rounded (int8: half away from zero, clamped to +-127; fp8: the
conversion's rounding) and the scale beside it, so that a reader's
x.to(float32) * scale is within half a step of x.

Grid (T,): a program moves one token, all its KV heads, K and V.

Layouts:

    key, value     : (T, num_kv_heads, head_dim), last dim contiguous (views of
                     the fused qkv projection are fine)
    slot_mapping   : (T,) int64 (or int32), slot = block_id * block_size + offset
    key_cache...   : see paged_attention.py; k_scale/v_scale written when given

The slot's block id is multiplied by the pool's block stride in int64.
Scalar loads indexed by the program id are in range by the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamchat.kernels.paged_attention import QUANT_STORAGE, check_pool, scale_strides, slot_rows

Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def store_heads(src_ptr, dst_ptr, scale_ptr, src, dst, scale_dst, mask, head_mask,
                QUANT: tl.constexpr, Q_MAX: tl.constexpr, ROUND: tl.constexpr):
    """Copy a (KVH_PAD, D_PAD) tile of one token, quantizing per head when QUANT."""
    x = tl.load(src_ptr + src, mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / Q_MAX, 1.0)
        y = x / scale[:, None]
        if ROUND:
            y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
        y = tl.minimum(tl.maximum(y, -Q_MAX), Q_MAX)
        tl.store(dst_ptr + dst, y.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_dst, scale, mask=head_mask)
    else:
        tl.store(dst_ptr + dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_block, stride_offset, stride_head, stride_scale_block, stride_scale_offset, stride_scale_head,
    NUM_KV_HEADS: tl.constexpr, KVH_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, Q_MAX: tl.constexpr, ROUND: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    head_mask = h < NUM_KV_HEADS
    mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
    dst = slot_rows(block_id, offset, h, stride_block, stride_offset, stride_head)[:, None] + d[None, :]
    scale_dst = slot_rows(block_id, offset, h, stride_scale_block, stride_scale_offset, stride_scale_head)
    key_src = tok * stride_key_tok + h[:, None] * stride_key_head + d[None, :]
    value_src = tok * stride_value_tok + h[:, None] * stride_value_head + d[None, :]
    store_heads(key_ptr, key_cache_ptr, k_scale_ptr, key_src, dst, scale_dst, mask, head_mask,
                QUANT, Q_MAX, ROUND)
    store_heads(value_ptr, value_cache_ptr, v_scale_ptr, value_src, dst, scale_dst, mask, head_mask,
                QUANT, Q_MAX, ROUND)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """`reference.write_kv`, one launch; quantizes into int8/fp8 pools and writes their scales."""
    check_pool(key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and value.shape == key.shape
    assert key.dtype == value.dtype and key.stride(2) == 1 and value.stride(2) == 1
    assert slot_mapping.dtype in (torch.int64, torch.int32) and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    quant = key_cache.dtype in QUANT_STORAGE
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *scale_strides(k_scale),
        NUM_KV_HEADS=num_kv_heads, KVH_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=key_cache.shape[1], QUANT=quant,
        Q_MAX=Q_MAX.get(key_cache.dtype, 0.0), ROUND=key_cache.dtype == torch.int8, num_warps=4)
