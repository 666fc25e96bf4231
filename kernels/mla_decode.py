"""Paged MLA decode: one absorbed query per sequence over the latent pool, split along the sequence.

Computes what `mla_reference.paged_mla_decode` computes:

    out[b, h] = softmax_j(scale * [q_c | R(p - start_j) q_r] . row_j) @ c_j,   p = seq_lens[b] - 1

where row_j = [c_j | R(o_j) k_r,j] is token j's latent as stored (its rotary
part rotated by its offset in its block) and start_j its block's start: the
QUERY's rotary part is rotated once per paged block, never a stored row.
Every head reads the same row a token, so one program takes ALL heads of a
sequence over one range of tokens and reads each latent byte once a step:

    split kernel   grid (num_seqs, num_splits): scores (H_PAD, BLOCK_N) = q_c . c^T
                   + the rotated q_r . k_r^T, an online softmax, acc (H_PAD, C) += p @ c;
                   writes the range's max, sum and normalized output
    reduce kernel  decode.py's, over the splits, with HEAD_DIM = C

    tokens:  0 ........................................ seq_len
    splits:  [ split 0: tokens_per_split ][ split 1 ][ ... ]
    tiles:   [BLOCK_N][BLOCK_N]...   a tile lies inside one paged block (blocks of 16..64
                                     tokens, FlashMLA's 64 included) or holds SUB whole
                                     blocks, each scored with its own rotation of q_r

Layouts:

    q            : (num_seqs, num_heads, C + R) absorbed queries, q_r unrotated, last dim contiguous
    latent_cache : (num_blocks, block_size, C + R) float32/bf16/fp16, or int8/fp8 with
                   latent_scale (num_blocks, block_size, 2) float32: c's scale, then k_r's
                   (a stored x means x.to(float32) * its part's scale); last dims contiguous
    block_tables : (num_seqs, max_blocks) int32, seq_lens (num_seqs,) int32, >= 1
    cos, sin     : (max_pos, R) float32 rotate-half tables (the kernel reads the first halves)
    part_*       : `decode.DecodeSplits` with head_dim C: (num_seqs, num_heads, num_splits[, C])
    out          : (num_seqs, num_heads, C), q's dtype

`block_id * stride_block` is formed in int64. Scalar loads indexed by program
ids (seq_lens[seq]) are in range by the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamchat.kernels.decode import LOG2E, DecodeSplits, _decode_reduce_kernel, plan_decode
from streamchat.kernels.paged_attention import (NEG_BIG, check_rope, check_table, dot_dtype, qk_scores, rope_rows,
                                                rotate, softmax_step)

MAX_TILE = 32  # keys per tile: a (32, C) latent tile beside a (16, C) accumulator (C = 512 in DeepSeek's shapes)


@triton.jit
def load_latent_tile(latent_ptr, scale_ptr, rows, scale_rows, valid, LATENT: tl.constexpr, C_PAD: tl.constexpr,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Latent rows at element offsets `rows` (N,): c (N, C_PAD) and the rotary halves (N, HALF_PAD) x2,
    float32, dequantized by their part's scale when HAS_SCALE."""
    cc = tl.arange(0, C_PAD)
    dh = tl.arange(0, HALF_PAD)
    c_mask = valid[:, None] & (cc < LATENT)[None, :]
    r_mask = valid[:, None] & (dh < HALF)[None, :]
    c = tl.load(latent_ptr + rows[:, None] + cc[None, :], mask=c_mask, other=0.0).to(tl.float32)
    k1 = tl.load(latent_ptr + rows[:, None] + LATENT + dh[None, :], mask=r_mask, other=0.0).to(tl.float32)
    k2 = tl.load(latent_ptr + rows[:, None] + LATENT + HALF + dh[None, :], mask=r_mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        c = c * tl.load(scale_ptr + scale_rows, mask=valid, other=0.0)[:, None]
        r_scale = tl.load(scale_ptr + scale_rows + 1, mask=valid, other=0.0)[:, None]
        k1 = k1 * r_scale
        k2 = k2 * r_scale
    return c, k1, k2


# Step-shaped ints are not specialized: one compile serves every batch, table width and split count.
@triton.jit(do_not_specialize=["tokens_per_split", "stride_table", "stride_stat_seq", "stride_stat_head"])
def _mla_split_kernel(
    q_ptr, latent_ptr, scale_ptr, table_ptr, seq_lens_ptr, cos_ptr, sin_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr, qk_scale, tokens_per_split,
    stride_q_seq, stride_q_head, stride_block, stride_offset, stride_scale_block, stride_scale_offset,
    stride_table, stride_cos, stride_stat_seq, stride_stat_head,
    HEADS: tl.constexpr, H_PAD: tl.constexpr, LATENT: tl.constexpr, C_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    h = tl.arange(0, H_PAD)
    cc = tl.arange(0, C_PAD)
    dh = tl.arange(0, HALF_PAD)
    h_mask = h < HEADS
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_seq + h[:, None] * stride_q_head
    r_mask = h_mask[:, None] & (dh < HALF)[None, :]
    q_c = tl.load(q_rows + cc[None, :], mask=h_mask[:, None] & (cc < LATENT)[None, :], other=0.0)
    q_c = q_c.to(tl.float32) * qk_scale
    q1 = tl.load(q_rows + LATENT + dh[None, :], mask=r_mask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows + LATENT + HALF + dh[None, :], mask=r_mask, other=0.0).to(tl.float32) * qk_scale
    q_pos = seq_len - 1
    row = tl.zeros([1], tl.int32)  # one rope row per (sub-)block, broadcast over the heads

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    m_i = tl.full([H_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, C_PAD], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        valid = tokens < end
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = (tokens % BLOCK_SIZE).to(tl.int64)
        c, k1, k2 = load_latent_tile(latent_ptr, scale_ptr, block_ids * stride_block + offsets * stride_offset,
                                     block_ids * stride_scale_block + offsets * stride_scale_offset, valid,
                                     LATENT, C_PAD, HALF, HALF_PAD, HAS_SCALE)
        s = tl.dot(q_c.to(DOT_DTYPE), tl.trans(c.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # (H_PAD, BLOCK_N)
        s_r = tl.zeros([H_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(SUB):  # SUB > 1 only for blocks under a tile
            block_start = (n0 + j * BLOCK_SIZE) // BLOCK_SIZE * BLOCK_SIZE
            delta = row + tl.maximum(q_pos - block_start, 0)  # (1,); a block past the end is masked
            cr, sr = rope_rows(cos_ptr, sin_ptr, delta, row == 0, stride_cos, HALF, HALF_PAD)  # (1, HALF_PAD)
            qa, qb = rotate(q1, q2, cr, sr)
            s_j = qk_scores(qa, qb, k1, k2, DOT_DTYPE, DOT_PRECISION)
            s_r = tl.where((tokens // BLOCK_SIZE * BLOCK_SIZE == block_start)[None, :], s_j, s_r)
        m_i, l_i, acc = softmax_step(s + s_r, c, valid[None, :], m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

    # An empty split (past its sequence's end) writes sum 0 and output 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    stat = seq.to(tl.int64) * stride_stat_seq + h * stride_stat_head + split  # (H_PAD,)
    tl.store(part_out_ptr + stat[:, None] * LATENT + cc[None, :], out,
             mask=h_mask[:, None] & (cc < LATENT)[None, :])
    tl.store(part_max_ptr + stat, m_i, mask=h_mask)
    tl.store(part_sum_ptr + stat, l_i, mask=h_mask)


def tile_keys(block_size: int, block_n: int) -> int:
    """Keys per tile: the split plan's tile, at most MAX_TILE (a divisor of it: both powers of two)."""
    tile = min(block_n, MAX_TILE)
    assert tile % block_size == 0 or block_size % tile == 0, "a tile holds whole blocks or lies in one"
    return tile


def check_latent(latent_cache: torch.Tensor, latent_scale: torch.Tensor | None) -> None:
    """Assert the latent pool's layout, dtype and scales are what the kernel addresses."""
    assert latent_cache.dim() == 3 and latent_cache.stride(2) == 1, "latent pool: (num_blocks, block_size, C + R)"
    quantized = latent_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    assert quantized or latent_cache.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        f"unsupported latent storage {latent_cache.dtype} (int4 runs on the torch backend)"
    assert (latent_scale is not None) == quantized, "int8/fp8 latents need their scales; float ones take none"
    if quantized:
        assert latent_scale.shape == (*latent_cache.shape[:2], 2) and latent_scale.dtype == torch.float32
        assert latent_scale.stride(2) == 1


def paged_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                     latent_scale: torch.Tensor | None = None, num_splits: int | None = None,
                     block_n: int | None = None, splits: DecodeSplits | None = None) -> torch.Tensor:
    """q (B, H, C + R) -> out (B, H, C); `mla_reference.paged_mla_decode`.

    splits: a step's plan (`decode.plan_decode` with one KV head and head_dim C), shared by its
    layers; else one is made here, with num_splits and block_n as overrides.
    """
    num_seqs, num_heads, width = q.shape
    _, block_size, pool_width = latent_cache.shape
    rope_dim = cos.shape[1]
    latent_dim = width - rope_dim
    check_latent(latent_cache, latent_scale)
    check_rope(cos, sin, rope_dim)
    check_table(block_tables, seq_lens, num_seqs)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.stride(2) == 1
    assert pool_width == width and rope_dim % 2 == 0
    if splits is None:
        splits = plan_decode(num_seqs, num_heads, 1, latent_dim, block_tables.shape[1], block_size, q.device,
                             num_splits, block_n, q.dtype)
    part_out, part_max, part_sum = splits.part_out, splits.part_max, splits.part_sum
    assert part_out.shape[:2] == (num_seqs, num_heads) and part_out.shape[3] == latent_dim
    num_splits = part_max.shape[2]
    tile = tile_keys(block_size, splits.block_n)
    out = torch.empty(num_seqs, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    dtype, precision = dot_dtype(q.dtype, _mla_split_kernel)
    c_pad = max(16, triton.next_power_of_2(latent_dim))
    scale_strides = (0, 0) if latent_scale is None else latent_scale.stride()[:2]
    _mla_split_kernel[(num_seqs, num_splits)](
        q, latent_cache, latent_scale, block_tables, seq_lens, cos, sin, part_out, part_max, part_sum,
        scale * LOG2E, splits.tokens_per_split, q.stride(0), q.stride(1), *latent_cache.stride()[:2],
        *scale_strides, block_tables.stride(0), cos.stride(0), *part_max.stride()[:2],
        HEADS=num_heads, H_PAD=max(16, triton.next_power_of_2(num_heads)), LATENT=latent_dim, C_PAD=c_pad,
        HALF=rope_dim // 2, HALF_PAD=max(16, triton.next_power_of_2(rope_dim // 2)), BLOCK_SIZE=block_size,
        BLOCK_N=tile, SUB=max(1, tile // block_size), HAS_SCALE=latent_scale is not None,
        DOT_DTYPE=dtype, DOT_PRECISION=precision, num_warps=8)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_max, part_sum, out, num_splits, *part_max.stride()[:2], out.stride(0), out.stride(1),
        HEAD_DIM=latent_dim, D_PAD=c_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out
