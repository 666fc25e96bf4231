"""Paged decode attention: one query token per sequence, split along the sequence (flash-decoding).

Computes what `reference.paged_decode_attention` computes:

    out[b, h] = softmax(rope(q[b, h], p) . rope(K_b)^T * scale) @ V_b,   p = seq_lens[b] - 1

over the seq_lens[b] tokens of sequence b's table. Keys are stored rotated
by their offset in their block, so the kernel rotates the QUERY instead,
once per paged block, by (p - block start), and never touches a key's
rotation. Two kernels:

    split kernel   grid (num_seqs, num_kv_heads, num_splits)
                   one program reads ONE KV head over one range of tokens and
                   attends all G = H / KVH query heads of its group to it, so
                   each KV byte is read once per step; it writes the range's
                   running max, sum and normalized output
    reduce kernel  grid (num_seqs, num_heads): merges the splits

    tokens:  0 ........................................ seq_len
    splits:  [ split 0: tokens_per_split ][ split 1 ][ split 2 .. ]
    tiles:   [BLOCK_N][BLOCK_N]...   a tile lies inside one paged block, or (blocks
                                     under 16 tokens) holds SUB whole blocks, each
                                     scored with its own rotation of the query
    query:   rotated per tile (sub-block) by p - block start: one cos/sin row each

Layouts:

    q            : (num_seqs, num_heads, head_dim), unrotated, last dim contiguous
    key_cache... : see paged_attention.py
    block_tables : (num_seqs, max_blocks) int32, seq_lens (num_seqs,) int32, >= 1
    part_max     : (num_seqs, num_heads, num_splits) float32 contiguous, a split's max
                   score (log2 domain); part_sum the same, its sum of exp2(s - max)
    part_out     : (num_seqs, num_heads, num_splits, head_dim) float32 contiguous, its
                   normalized output: element (i, d) at i * head_dim + d, i the
                   (seq, head, split) index of part_max
    out          : (num_seqs, num_heads, head_dim), q's dtype

Scalar loads indexed by program ids (seq_lens[seq]) are in range by the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from typing import NamedTuple

from streamchat.kernels.paged_attention import (NEG_BIG, check_pool, check_rope, check_table, dot_dtype,
                                                head_tiles, load_kv_tile, qk_scores, rope_rows, rotate,
                                                scale_strides, softmax_step)

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it buys
MAX_SPLITS = 64


# Step-shaped ints are not specialized (an int equal to 1 or a multiple of 16 would each
# compile a variant): one compile serves every batch, table width and split count.
@triton.jit(do_not_specialize=["tokens_per_split", "stride_table", "stride_stat_seq", "stride_stat_head"])
def _decode_split_kernel(
    q_ptr, key_ptr, value_ptr, k_scale_ptr, v_scale_ptr, table_ptr, seq_lens_ptr, cos_ptr, sin_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr, qk_scale, tokens_per_split,
    stride_q_seq, stride_q_head, stride_block, stride_offset, stride_head,
    stride_scale_block, stride_scale_offset, stride_scale_head, stride_table, stride_cos,
    stride_stat_seq, stride_stat_head,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, G_PAD)
    dh = tl.arange(0, HALF_PAD)
    d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + g  # (G_PAD,) the query heads of this KV head's group
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_seq + head[:, None] * stride_q_head
    q_mask = (g < GROUP)[:, None] & (dh < HALF)[None, :]
    q1 = tl.load(q_rows + dh[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows + HALF + dh[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q_pos = seq_len - 1
    row = tl.zeros([1], tl.int32)  # one rope row per (sub-)block, broadcast over the group's heads

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        valid = tokens < end
        k1, k2, v = load_kv_tile(key_ptr, value_ptr, k_scale_ptr, v_scale_ptr, table_row, tokens, valid,
                                 kv_head, stride_block, stride_offset, stride_head, stride_scale_block,
                                 stride_scale_offset, stride_scale_head, HALF, HALF_PAD, HEAD_DIM, D_PAD,
                                 BLOCK_SIZE, HAS_SCALE)
        s = tl.zeros([G_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(SUB):  # SUB > 1 only for blocks under 16 tokens
            block_start = (n0 + j * BLOCK_SIZE) // BLOCK_SIZE * BLOCK_SIZE
            delta = row + tl.maximum(q_pos - block_start, 0)  # (1,); a block past the end is masked
            c, sn = rope_rows(cos_ptr, sin_ptr, delta, row == 0, stride_cos, HALF, HALF_PAD)  # (1, HALF_PAD)
            qa, qb = rotate(q1, q2, c, sn)
            s_j = qk_scores(qa, qb, k1, k2, DOT_DTYPE, DOT_PRECISION)
            s = tl.where((tokens // BLOCK_SIZE * BLOCK_SIZE == block_start)[None, :], s_j, s)
        m_i, l_i, acc = softmax_step(s, v, valid[None, :], m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

    # An empty split (past its sequence's end) writes sum 0 and output 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    stat = seq.to(tl.int64) * stride_stat_seq + head * stride_stat_head + split  # (G_PAD,)
    g_mask = g < GROUP
    tl.store(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :], out,
             mask=g_mask[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(part_max_ptr + stat, m_i, mask=g_mask)
    tl.store(part_sum_ptr + stat, l_i, mask=g_mask)


# As the split kernel; one compile per power of two of the split count (SPLITS_PAD, at most 7).
@triton.jit(do_not_specialize=["num_splits", "stride_stat_seq", "stride_stat_head"])
def _decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
    stride_stat_seq, stride_stat_head, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    stat = seq.to(tl.int64) * stride_stat_seq + head * stride_stat_head + s  # (SPLITS_PAD,)
    m = tl.load(part_max_ptr + stat, mask=s_mask, other=NEG_BIG)
    l = tl.load(part_sum_ptr + stat, mask=s_mask, other=0.0)
    o = tl.load(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0)) * l  # (SPLITS_PAD,) each split's share of the softmax mass
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    out_off = seq.to(tl.int64) * stride_out_seq + head * stride_out_head + d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def plan_splits(num_programs: int, max_tokens: int, num_sms: int) -> int:
    """Splits per sequence so that about two programs per SM run, none shorter than MIN_SPLIT_TOKENS.

    num_programs is num_seqs * num_kv_heads; max_tokens bounds every sequence's
    length (table width * block_size: known on the host without a sync).
    """
    want = -(-2 * num_sms // num_programs)
    by_len = max(1, max_tokens // MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, MAX_SPLITS))


def split_tokens(max_tokens: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(num_splits, tokens_per_split): whole tiles per split, no split left empty for the longest sequence."""
    tokens_per_split = -(-max_tokens // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    return -(-max_tokens // tokens_per_split), tokens_per_split


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; CPU (interpreter) runs count as 4."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


WIDE_TILE = 64  # keys per tile for 16-bit queries (see tile_keys)


def tile_keys(block_size: int, block_n: int | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Keys per tile: 64 for 16-bit queries (SUB = 64 / block_size blocks a tile for small blocks),
    else inside one block (16..64 of it), or whole blocks when blocks are under 16 tokens.

    ptxas (sm_90, Llama-8B head shape, 8 warps) fits a 64-key tile over 16-token blocks in 229
    registers for bf16 (172 with an int8 pool), no spills; float32 spills 752 bytes, so fp32 models
    keep one block a tile (90 registers).
    """
    if block_n is None:
        wide = dtype in (torch.bfloat16, torch.float16) and (WIDE_TILE % block_size == 0
                                                             or block_size % WIDE_TILE == 0)
        block_n = WIDE_TILE if wide else max(16, min(64, block_size))
    assert block_n % block_size == 0 or block_size % block_n == 0, "a tile holds whole blocks or lies in one"
    return block_n


class DecodeSplits(NamedTuple):
    """The split plan and its partial-result buffers: the same for every layer of a step."""

    block_n: int
    tokens_per_split: int
    part_out: torch.Tensor  # (num_seqs, num_heads, num_splits, head_dim) float32
    part_max: torch.Tensor  # (num_seqs, num_heads, num_splits) float32
    part_sum: torch.Tensor


def plan_decode(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_blocks: int,
                block_size: int, device: torch.device, num_splits: int | None = None,
                block_n: int | None = None, dtype: torch.dtype = torch.float32) -> DecodeSplits:
    """Splits and their buffers for a step of `num_seqs` sequences of at most max_blocks blocks.

    num_splits and block_n override the plan (tests use them to force splits); dtype is the
    query's (it picks the tile, `tile_keys`).
    """
    block_n = tile_keys(block_size, block_n, dtype)
    max_tokens = max_blocks * block_size
    if num_splits is None:
        num_splits = plan_splits(num_seqs * num_kv_heads, max_tokens, num_sms(device))
    splits, tokens_per_split = split_tokens(max_tokens, num_splits, block_n)
    part_max = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=device)
    return DecodeSplits(block_n, tokens_per_split,
                        torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=device),
                        part_max, torch.empty_like(part_max))


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 num_splits: int | None = None, block_n: int | None = None,
                 splits: DecodeSplits | None = None) -> torch.Tensor:
    """q (B, H, D) -> out (B, H, D); `reference.paged_decode_attention` plus scales for int8/fp8 pools.

    splits: a step's plan (`plan_decode`), shared by its layers; else one is
    made here, with num_splits and block_n as overrides.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, pool_head_dim = key_cache.shape
    check_pool(key_cache, value_cache, k_scale, v_scale)
    check_rope(cos, sin, head_dim)
    check_table(block_tables, seq_lens, num_seqs)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.stride(2) == 1
    assert pool_head_dim == head_dim and num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    if splits is None:
        splits = plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, block_tables.shape[1], block_size,
                             q.device, num_splits, block_n, q.dtype)
    part_out, part_max, part_sum = splits.part_out, splits.part_max, splits.part_sum
    assert part_out.shape[:2] == (num_seqs, num_heads) and part_out.shape[3] == head_dim
    num_splits = part_max.shape[2]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    tiles = head_tiles(head_dim)
    dtype, precision = dot_dtype(q.dtype, _decode_split_kernel)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, cos, sin,
        part_out, part_max, part_sum, scale * LOG2E, splits.tokens_per_split,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *scale_strides(k_scale),
        block_tables.stride(0), cos.stride(0), *part_max.stride()[:2],
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=splits.block_n, SUB=max(1, splits.block_n // block_size), HAS_SCALE=k_scale is not None,
        DOT_DTYPE=dtype, DOT_PRECISION=precision,
        num_warps=8, **tiles)  # 8 warps: 90-128 registers (sm_90 cubin), no spills
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_max, part_sum, out, num_splits, *part_max.stride()[:2], out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=tiles["D_PAD"], SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out
