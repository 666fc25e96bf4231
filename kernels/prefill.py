"""Paged prefill attention: varlen chunks of many sequences in one launch, causal, online softmax.

Computes what `reference.paged_prefill_attention` computes: query i of a
chunk of n queries of sequence b sits at cache position p = seq_lens[b] - n + i
and attends to every cached key of b at a position <= p: the blocks written
before this step and the chunk's own keys (written just before the call).
Queries arrive unrotated: a program rotates its query rows by their cache
positions once, then each tile of keys by its block's start (keys are stored
rotated by their offset in the block, so R(start) R(o) k = R(p_k) k). That
is O(keys) per tile, but one tile serves BLOCK_M * G query rows; rotating
the queries per block instead would cost a rotation of all R rows per tile
(and one rope row per query row instead of one per key).

    sequence b:  0 ....... cached ........ seq_len-n ... chunk ... seq_len
    query tile:                                      [BLOCK_M queries]
    keys seen:   [ 0 ............................. last query's position ]

Grid (num_tiles, num_kv_heads). A program takes BLOCK_M queries of one
sequence and all G query heads of one KV head: R = BLOCK_M * G_PAD query rows
(row r = query r // G_PAD, head r % G_PAD of the group), so each KV tile is
read once per query tile, not once per query head. Tiles are numbered
sequence after sequence; a program finds its sequence from cu_seqlens_q
itself (a prefix sum of tiles per sequence, in registers), so the launch
runs no torch op and needs no device-to-host sync. A sequence wastes at most
one partial tile, so cdiv(T, BLOCK_M) + num_seqs programs always suffice; the
extra ones find no sequence and write nothing.

Layouts:

    q, out       : (T, num_heads, head_dim), q unrotated, sequence b's queries at
                   rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]; last dim contiguous
    cu_seqlens_q : (num_seqs + 1,) int32
    block_tables : (num_seqs, max_blocks) int32, seq_lens (num_seqs,) int32
    key_cache... : see paged_attention.py

Scalar loads indexed by program ids or by the search (seq < num_seqs) are in range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamchat.kernels.paged_attention import (NEG_BIG, check_pool, check_rope, check_table, dot_dtype,
                                                head_tiles, load_kv_tile, qk_scores, rope_rows, rotate,
                                                scale_strides, softmax_step)

LOG2E = 1.4426950408889634


@triton.jit
def find_seq(cu_q_ptr, tile, num_seqs, BLOCK_M: tl.constexpr, SEQS_PAD: tl.constexpr):
    """(seq, its first tile) for a program's tile; seq >= num_seqs when the tile is past the last.

    Sequence b has cdiv(n_b, BLOCK_M) tiles, numbered after those of 0..b-1.
    """
    b = tl.arange(0, SEQS_PAD)
    in_range = b < num_seqs
    num_q = tl.load(cu_q_ptr + b + 1, mask=in_range, other=0) - tl.load(cu_q_ptr + b, mask=in_range, other=0)
    tiles = (num_q + BLOCK_M - 1) // BLOCK_M  # (SEQS_PAD,), 0 past num_seqs
    ends = tl.cumsum(tiles, axis=0)  # one past each sequence's last tile
    seq = tl.sum((ends <= tile).to(tl.int32), axis=0)
    return seq, tl.sum(tl.where(b < seq, tiles, 0), axis=0)


# Step-shaped ints are not specialized (an int equal to 1 or a multiple of 16 would each
# compile a variant): one compile per power of two of the number of sequences (SEQS_PAD).
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _prefill_kernel(
    q_ptr, key_ptr, value_ptr, k_scale_ptr, v_scale_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
    cos_ptr, sin_ptr, out_ptr, qk_scale, num_seqs,
    stride_q_tok, stride_q_head, stride_out_tok, stride_out_head, stride_block, stride_offset, stride_head,
    stride_scale_block, stride_scale_offset, stride_scale_head, stride_table, stride_cos,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, SEQS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, first_tile = find_seq(cu_q_ptr, tile, num_seqs, BLOCK_M, SEQS_PAD)
    if seq < num_seqs:
        q_start = tl.load(cu_q_ptr + seq)
        num_q = tl.load(cu_q_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        first_q = (tile - first_tile) * BLOCK_M  # within the chunk
        r = tl.arange(0, BLOCK_M * G_PAD)
        g = r % G_PAD
        q_idx = first_q + r // G_PAD  # (R,) index within the chunk
        row_valid = (q_idx < num_q) & (g < GROUP)
        q_pos = seq_len - num_q + q_idx  # (R,) cache positions
        head = kv_head * GROUP + g
        dh = tl.arange(0, HALF_PAD)
        d = tl.arange(0, D_PAD)
        q_rows = q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head
        q_mask = row_valid[:, None] & (dh < HALF)[None, :]
        q1 = tl.load(q_rows + dh[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q2 = tl.load(q_rows + HALF + dh[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        qc, qs = rope_rows(cos_ptr, sin_ptr, q_pos, row_valid, stride_cos, HALF, HALF_PAD)  # (R, HALF_PAD)
        q1, q2 = rotate(q1, q2, qc, qs)  # by cache position, once

        m_i = tl.full([BLOCK_M * G_PAD], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
        kv_end = tl.minimum(seq_len, seq_len - num_q + first_q + BLOCK_M)  # past the tile's last query
        table_row = table_ptr + seq.to(tl.int64) * stride_table
        for n0 in range(0, kv_end, BLOCK_N):
            tokens = n0 + tl.arange(0, BLOCK_N)
            valid = tokens < kv_end
            k1, k2, v = load_kv_tile(key_ptr, value_ptr, k_scale_ptr, v_scale_ptr, table_row, tokens, valid,
                                     kv_head, stride_block, stride_offset, stride_head, stride_scale_block,
                                     stride_scale_offset, stride_scale_head, HALF, HALF_PAD, HEAD_DIM, D_PAD,
                                     BLOCK_SIZE, HAS_SCALE)
            kc, ks = rope_rows(cos_ptr, sin_ptr, tokens // BLOCK_SIZE * BLOCK_SIZE, valid, stride_cos, HALF,
                               HALF_PAD)  # (BLOCK_N, HALF_PAD): the rows of each key's block start
            k1, k2 = rotate(k1, k2, kc, ks)  # R(block start) R(offset) k = k rotated by its cache position
            s = qk_scores(q1, q2, k1, k2, DOT_DTYPE, DOT_PRECISION)
            causal = valid[None, :] & (tokens[None, :] <= q_pos[:, None])
            m_i, l_i, acc = softmax_step(s, v, causal, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = (q_start + q_idx).to(tl.int64)[:, None] * stride_out_tok + head[:, None] * stride_out_head
        tl.store(out_ptr + out_rows + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (d < HEAD_DIM)[None, :])


def paged_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, rows: int = 64, block_n: int | None = None) -> torch.Tensor:
    """q (T, H, D) -> out (T, H, D); `reference.paged_prefill_attention` plus scales for int8/fp8 pools.

    rows is the query rows per program (BLOCK_M * G_PAD); block_n the keys per tile.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, pool_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    check_pool(key_cache, value_cache, k_scale, v_scale)
    check_rope(cos, sin, head_dim)
    check_table(block_tables, seq_lens, num_seqs)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (num_seqs + 1,)
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.stride(2) == 1
    assert pool_head_dim == head_dim and num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_m = max(16, rows, g_pad) // g_pad  # >= 16 rows: tl.dot's smallest tile
    if block_n is None:  # 64 keys a tile (any block size: each key is rotated by its own block's start)
        wide = q.dtype in (torch.bfloat16, torch.float16) and k_scale is None
        block_n = 64 if wide else max(16, min(64, block_size))
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    dtype, precision = dot_dtype(q.dtype, _prefill_kernel)
    grid = (triton.cdiv(num_tokens, block_m) + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, cu_seqlens_q,
        cos, sin, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *key_cache.stride()[:3],
        *scale_strides(k_scale), block_tables.stride(0), cos.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, SEQS_PAD=max(2, triton.next_power_of_2(num_seqs)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HAS_SCALE=k_scale is not None, DOT_DTYPE=dtype, DOT_PRECISION=precision, num_warps=8,
        **head_tiles(head_dim))
    return out
