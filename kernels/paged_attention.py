"""Reading the paged KV pool through a block table: the pieces the attention kernels share.

Owns how a kernel turns (table, token) into an address, dequantizes a stored
key or value, rotates rows by rope rows, and folds one tile of scores into
an online softmax; and the launcher-side checks of the pool's layout.
It knows nothing about sequences, steps or the model: `decode.py` and
`prefill.py` own the grids.

Layouts (the same as `reference.py`):

    key_cache, value_cache : (num_blocks, block_size, num_kv_heads, head_dim)
                             float32/bf16/fp16, or int8/fp8 with scales;
                             each key stored rotated by its OFFSET in its block
                             (slot % block_size); the two tensors share shape,
                             strides and dtype, last dim contiguous (the block
                             stride may be anything)
    k_scale, v_scale       : None, or (num_blocks, block_size, num_kv_heads)
                             float32: a stored x means x.to(float32) * scale
    block table row        : int32 block ids; token t of the sequence sits at
                             table index t // block_size, offset t % block_size,
                             and t is also its cache position
    cos, sin               : (max_pos, head_dim) float32, rotate-half layout: the
                             halves repeat, so the kernels read the first half

    table index:    0      1      2      3         a query at cache position p
                  [ 17 ] [  4 ] [ 93 ] [ 41 ]      scores block i's R(o) k with
    block start:    0      16     32     48        R(p - 16 i) q: eviction moves
                                                   no data, rotates nothing stored

Addresses: `block_id * stride_block` is formed in int64 (a pool of 2**31
elements is 4 GiB of bf16, well inside one GPU). Everything else a kernel
multiplies is bounded by one block or one step's batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Storage dtypes a pool may have; quantized ones need scales.
FLOAT_STORAGE = (torch.float32, torch.bfloat16, torch.float16)
QUANT_STORAGE = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

# Finite "minus infinity" for running maxima: exp2(m - m_new) stays 0 or 1,
# never inf - inf = nan, even for a row that has seen no key yet.
NEG_BIG = tl.constexpr(-1.0e38)


@triton.jit
def slot_rows(block_ids, offsets, head, stride_block, stride_offset, stride_head):
    """Element offsets (int64) of slots (block_id, offset) of one KV head in a pool tensor."""
    return (block_ids.to(tl.int64) * stride_block + offsets.to(tl.int64) * stride_offset
            + head.to(tl.int64) * stride_head)


@triton.jit
def load_slots(cache_ptr, scale_ptr, rows, scale_rows, cols, valid, col_mask, HAS_SCALE: tl.constexpr):
    """A (N, C) tile: slots `rows` (N,), columns `cols` (C,); float32 x * scale if scaled, else as stored."""
    mask = valid[:, None] & col_mask[None, :]
    x = tl.load(cache_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + scale_rows, mask=valid, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    return x


@triton.jit
def load_kv_tile(key_ptr, value_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr, tokens, valid, head,
                 stride_block, stride_offset, stride_head, stride_scale_block, stride_scale_offset,
                 stride_scale_head, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """KV head `head` at `tokens` (N,) of one sequence, as stored: key halves (N, HALF_PAD) x2 in
    float32 (each rotated by its offset in its block), values (N, D_PAD) (float32 if scaled).

    Token t sits at table index t // BLOCK_SIZE, offset t % BLOCK_SIZE.
    """
    block_ids = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0)
    offsets = tokens % BLOCK_SIZE
    rows = slot_rows(block_ids, offsets, head, stride_block, stride_offset, stride_head)
    scale_rows = slot_rows(block_ids, offsets, head, stride_scale_block, stride_scale_offset,
                           stride_scale_head)
    dh = tl.arange(0, HALF_PAD)
    d = tl.arange(0, D_PAD)
    k1 = load_slots(key_ptr, k_scale_ptr, rows, scale_rows, dh, valid, dh < HALF, HAS_SCALE).to(tl.float32)
    k2 = load_slots(key_ptr, k_scale_ptr, rows, scale_rows, dh + HALF, valid, dh < HALF, HAS_SCALE).to(tl.float32)
    v = load_slots(value_ptr, v_scale_ptr, rows, scale_rows, d, valid, d < HEAD_DIM, HAS_SCALE)
    return k1, k2, v


@triton.jit
def rope_rows(cos_ptr, sin_ptr, pos, valid, stride_cos, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """First halves of the cos and sin rows at `pos` (R,): (R, HALF_PAD) float32 each, 0 where not valid."""
    dh = tl.arange(0, HALF_PAD)
    offs = pos.to(tl.int64)[:, None] * stride_cos + dh[None, :]
    mask = valid[:, None] & (dh < HALF)[None, :]
    return tl.load(cos_ptr + offs, mask=mask, other=0.0), tl.load(sin_ptr + offs, mask=mask, other=0.0)


@triton.jit
def rotate(x1, x2, c, s):
    """Rotate-half rotation of halves x1, x2 by rows c, s (broadcast): (x1 c - x2 s, x2 c + x1 s)."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def qk_scores(q1, q2, k1, k2, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores (R, N) of query halves (R, HALF_PAD) against key halves (N, HALF_PAD): q1.k1 + q2.k2."""
    s = tl.dot(q1.to(DOT_DTYPE), tl.trans(k1.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    return s + tl.dot(q2.to(DOT_DTYPE), tl.trans(k2.to(DOT_DTYPE)), input_precision=DOT_PRECISION)


@triton.jit
def softmax_step(s, v, mask, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile's scores s (R, N) and values v (N, D_PAD) into the online softmax (log2 domain).

    Scores come from queries pre-multiplied by scale * log2(e); mask (R, N)
    marks the keys a row sees. Returns the new running max m_i (R,), sum l_i
    (R,) and unnormalized acc (R, D_PAD).
    """
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ---- launcher side -------------------------------------------------------------------------


def check_pool(key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> None:
    """Assert the pool's layout, dtype and scales are what the kernels address."""
    assert key_cache.dim() == 4, f"pool must be (num_blocks, block_size, kv_heads, head_dim), got {key_cache.shape}"
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.dtype == value_cache.dtype and key_cache.device == value_cache.device
    assert key_cache.stride(3) == 1, "head_dim must be contiguous"
    assert key_cache.dtype in FLOAT_STORAGE + QUANT_STORAGE, f"unsupported KV storage {key_cache.dtype}"
    assert key_cache.shape[3] % 2 == 0, "rotate-half needs an even head_dim"
    quantized = key_cache.dtype in QUANT_STORAGE
    assert (k_scale is not None) == quantized and (v_scale is not None) == quantized, \
        "int8/fp8 pools need k_scale and v_scale; float pools take none"
    if quantized:
        assert k_scale.shape == key_cache.shape[:3] and v_scale.shape == k_scale.shape
        assert k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1


def scale_strides(k_scale: torch.Tensor | None) -> tuple[int, int, int]:
    """(block, offset, head) strides of the scales; zeros when the pool is not quantized."""
    return (0, 0, 0) if k_scale is None else tuple(k_scale.stride())


def check_rope(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    assert cos.dtype == sin.dtype == torch.float32, "cos/sin tables are float32"
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == head_dim
    assert cos.stride() == sin.stride() and cos.stride(1) == 1


def check_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int) -> None:
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2
    assert block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,) and seq_lens.is_contiguous()


def dot_dtype(q_dtype: torch.dtype, kernel) -> tuple[tl.dtype, str]:
    """Operand dtype and precision of the kernels' tl.dot calls.

    float32 models get IEEE float32 products (no TF32), so they match the
    reference to float32 rounding. 16-bit models multiply in their own dtype
    on the tensor cores, except under the interpreter, whose tl.dot treats
    bfloat16 (stored there as uint16) as integers: there they use float32.
    """
    if q_dtype == torch.float32 or is_interpreted(kernel):
        return tl.float32, "ieee"
    return (tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16), "tf32"


def is_interpreted(kernel) -> bool:
    """Whether TRITON_INTERPRET was set when the kernel was decorated."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def head_tiles(head_dim: int) -> dict:
    """The constexprs every attention kernel takes for one head_dim."""
    half = head_dim // 2
    return dict(HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), HALF=half,
                HALF_PAD=max(16, triton.next_power_of_2(half)))
