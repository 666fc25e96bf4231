"""Pure-torch paged attention: the CPU backend and the oracle the Triton kernels must match.

Layouts (every function here shares them with its kernel in this package):

    key_cache, value_cache : (num_blocks, block_size, num_kv_heads, head_dim)
                             each key stored rotated by its OFFSET in its block
                             (slot % block_size), never by its cache position
    block_tables           : (num_seqs, max_blocks) int32, padded with block 0
    seq_lens               : (num_seqs,) int32, tokens in the cache per sequence,
                             the ones written this step included
    cos, sin               : (max_pos, head_dim) float32, rotate-half layout
                             (the halves repeat), indexed by a position or a
                             difference of positions (never negative)
    k_scale, v_scale       : None for an unquantized pool; else its scales (see quant.py;
                             int4 keys: (num_blocks, num_kv_heads, head_dim, 2), per channel)

Queries and keys arrive unrotated. A key at table index i, offset o has cache
position i * block_size + o and is stored as R(o) k. RoPE is a rotation, so a
query at cache position p scores it as

    R(p) q . R(i * bs + o) k  =  R(p - i * bs) q . R(o) k

    table idx:     0      1      2      3
    block id:    [ 17 ] [  4 ] [ 93 ] [ 41 ]     every block holds R(o) k, o = 0 .. bs-1
    block start:   0      16     32     48       what it sits behind is not in its bytes

A block's bytes depend on its tokens alone: evicting the blocks before it
(which shifts its table index) moves and rewrites nothing, and a shared block
is read the same by every table that holds it. Rotation work per step:

    decode   the query once per block, by (p - block start): (B, KVH, max_blocks, G, D)
             queries, each scored against its block's keys as stored
    prefill  the chunk's queries by p, and each gathered block of keys by its block
             start: O(keys), shared by every query of the chunk. Per-block queries
             cost O(chunk x blocks) and measured slower from 4 queries a chunk on
             (1.6x at 4, 11x at 64, 14x at 512; a one-token chunk is what decode does)

The `*_plan` functions hold everything a step's layers share (gather
indices, rotation rows, masks, the host-side split of the chunks); the
backend builds them once per step. The oracles with the kernels' signatures
build a plan and run it.

Attention mass (the h2o eviction's scores): decode and prefill take an
optional `block_mass` (num_seqs, >= max_blocks) float32 output and ADD to it,
per sequence and table index, the softmax probabilities of the keys in that
block summed over every query head and query token of the sequence (so each
query token adds num_heads in all; the runner divides by heads and layers).

Oracles never mutate their inputs (write_kv is the one write, by design;
`block_mass` is an output).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from streamchat.kernels import quant


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos rows (*pos.shape, D) and sin half-rows (*pos.shape, D // 2) at `pos`, in `dtype`."""
    half = cos.shape[1] // 2
    return cos[pos].to(dtype), sin[pos, :half].to(dtype)


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x (..., D) by rope rows c (..., D) and s (..., D // 2), broadcast against x (into `out`).

    x * c, then each half takes its rotated partner times sin in place
    (out1 -= x2 s, out2 += x1 s; the tables repeat their halves): three
    passes instead of the five of `x * cos + rotate_half(x) * sin`.
    Rows expanded to x's shape beforehand run about twice as fast on CPU
    as rows broadcast over an inner dimension.
    """
    half = x.shape[-1] // 2
    out = torch.mul(x, c, out=out)
    out[..., :half].addcmul_(x[..., half:], s, value=-1)
    out[..., half:].addcmul_(x[..., :half], s)
    return out


def head_rows(c: torch.Tensor, s: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (..., D), (..., D // 2) repeated over `heads`: (..., heads, D) contiguous, for `rotate`."""
    return (c.unsqueeze(-2).expand(*c.shape[:-1], heads, c.shape[-1]).contiguous(),
            s.unsqueeze(-2).expand(*s.shape[:-1], heads, s.shape[-1]).contiguous())


class Workspace:
    """Scratch tensors by name, reused by every layer and step, grown on demand (the torch backend owns one).

    Without it a decode step allocates and frees tens of MB per layer (the
    gathered keys and values). Freed, glibc may hand blocks that large back
    to the OS, and faulting them in again costs more than the gather: at 16
    sessions x 2,064 tokens some runs fell into ~350,000 page faults and
    1.2 s of system time per step, twice the step's own work. A tensor taken
    is valid until its name is taken again.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def scratch(workspace: Workspace | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A tensor to write into: the workspace's `name`, or a new one without a workspace."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.take(name, shape, dtype, device)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, ...) -> (num_blocks * block_size, ...)."""
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


# ---- write ------------------------------------------------------------------------------------


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Scatter key/value (T, num_kv_heads, head_dim) into their slots (T,) of the pool.

    Each key is rotated by its offset in its block (slot % block_size), in
    float32, then stored: cast to the pool's dtype, or quantized after the
    rotation into a quantized pool (scales given; see quant.py).
    """
    offsets = slot_mapping % key_cache.shape[1]
    c, s = rope_rows(cos, sin, offsets, torch.float32)
    store_kv(key_cache, value_cache, key, value, slot_mapping, c[:, None], s[:, None], k_scale, v_scale)


def store_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, key_cos: torch.Tensor, key_sin: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """`write_kv` with the keys' float32 rotation rows given: (T, 1, D) and (T, 1, D // 2)."""
    key = rotate(key.float(), key_cos, key_sin)  # (T, KVH, D)
    if k_scale is None:
        _flat(key_cache)[slot_mapping] = key.to(key_cache.dtype)
        _flat(value_cache)[slot_mapping] = value.to(value_cache.dtype)
        return
    pairs = ((key, key_cache, k_scale), (value, value_cache, v_scale))
    if quant.per_channel(key_cache, k_scale):  # int4 keys: a scale per channel per block
        requantize_blocks(key_cache, k_scale, key, slot_mapping)
        pairs = pairs[1:]
    for x, cache, scale in pairs:
        stored, scales = quant.quantize(x, cache.dtype)
        _flat(cache)[slot_mapping] = stored
        _flat(scale)[slot_mapping] = scales


def requantize_blocks(key_cache: torch.Tensor, k_scale: torch.Tensor, key: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write rotated keys (T, KVH, D) into int4 blocks with per-channel scales, re-quantizing each
    block written under the max over its filled rows (offsets 0 .. the last one written).

    A table fills its blocks in order, so a block's rows before its first new one are its
    tokens so far; rows after its last are stale and ignored.
    """
    bs = key_cache.shape[1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    touched, which = torch.unique(blocks, return_inverse=True)  # (U,), (T,)
    x = quant.dequantize_channels(key_cache[touched], k_scale[touched], torch.float32)  # (U, bs, KVH, D)
    x[which, offsets] = key
    last = torch.full_like(touched, -1).scatter_reduce_(0, which, offsets, "amax")
    filled = torch.arange(bs, device=key.device) <= last[:, None]  # (U, bs)
    key_cache[touched], k_scale[touched] = quant.quantize_channels(x, filled)


def gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, dtype: torch.dtype,
                  workspace: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `block_ids` (N,) int64 as stored (dequantized to `dtype`): (N, block_size, KVH, D) each."""
    return (_gather(key_cache, k_scale, block_ids, dtype, workspace, "key"),
            _gather(value_cache, v_scale, block_ids, dtype, workspace, "value"))


def gather_rows(cache: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor, dtype: torch.dtype,
                workspace: Workspace | None = None, name: str = "rows") -> torch.Tensor:
    """Rows of a pool viewed as (num_blocks * block_size * KVH, width), dequantized to `dtype`: (R, D).

    With per-channel (int4 key) scales, `rows` must come in runs of one block's
    block_size offsets of one head, as `decode_plan` orders them.
    """
    if quant.per_channel(cache, scale):
        bs, kvh = cache.shape[1], cache.shape[2]
        x = torch.index_select(cache.view(-1, cache.shape[-1]), 0, rows)
        first = rows.view(-1, bs)[:, 0]  # each run's offset-0 row: (block * bs) * KVH + head
        run_scale = scale.view(-1, *scale.shape[-2:]).index_select(0, first // (bs * kvh) * kvh + first % kvh)
        return quant.dequantize_channels(x.view(-1, bs, x.shape[-1]), run_scale, dtype).view(rows.shape[0], -1)
    rows_scale = None if scale is None else scale.view(-1, *scale.shape[3:])
    return _gather(cache.view(-1, cache.shape[-1]), rows_scale, rows, dtype, workspace, name)


def _gather(pool: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype,
            workspace: Workspace | None, name: str) -> torch.Tensor:
    """pool[index] along dim 0 (index_select: ~5x faster than advanced indexing on CPU), dequantized."""
    shape = (index.shape[0], *pool.shape[1:])
    x = torch.index_select(pool, 0, index, out=scratch(workspace, name, shape, pool.dtype, pool.device))
    if scale is None:
        return x
    if quant.per_channel(pool, scale):  # int4 keys of whole blocks: (N, bs, KVH, D // 2), a scale per channel
        return quant.dequantize_channels(x, scale.index_select(0, index), dtype)
    out = None
    if x.dtype != torch.uint8:  # int8/fp8 dequantize in place of a temporary; int4 unpacks (new tensor)
        out = scratch(workspace, name + ".dequantized", shape, dtype, pool.device)
    return quant.dequantize(x, scale.index_select(0, index), dtype, out)


# ---- decode -----------------------------------------------------------------------------------


class DecodePlan(NamedTuple):
    """What every layer's decode shares in a step."""

    rows: torch.Tensor  # (B * KVH * max_blocks * block_size,) int64: pool rows, head-major (see decode_plan)
    q_cos: torch.Tensor  # (B, KVH, max_blocks, G, D) rows of (query position - block start)
    q_sin: torch.Tensor  # (B, KVH, max_blocks, G, D // 2)
    mask: torch.Tensor  # (B, 1, 1, max_blocks * block_size) bool: the keys each query sees
    workspace: Workspace | None = None  # where the gathered keys and values go


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_heads: int,
                num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                workspace: Workspace | None = None) -> DecodePlan:
    """The query of sequence b sits at seq_lens[b] - 1; block i starts at i * block_size.

    `rows` addresses the pool viewed as (num_blocks * block_size * KVH) rows
    of head_dim, in the order (sequence, KV head, table index, offset):
    gathered in that order, every KV head's keys of every block are one
    contiguous (block_size, D) matrix, and its values one (L, D) matrix per
    sequence, so the products run with no copy and no wasted head pairs.
    Blocks past a sequence's end (table padding) get rope row 0: their keys
    are masked.
    """
    num_seqs, max_blocks = block_tables.shape
    dev = block_tables.device
    offsets = torch.arange(block_size, device=dev)
    heads = torch.arange(num_kv_heads, device=dev)
    slots = block_tables.long()[:, None, :, None] * block_size + offsets  # (B, 1, NB, BS)
    rows = (slots * num_kv_heads + heads[None, :, None, None]).reshape(-1)  # (B, KVH, NB, BS) flattened
    starts = torch.arange(max_blocks, device=dev) * block_size
    delta = (seq_lens[:, None].long() - 1 - starts).clamp_(min=0)  # (B, NB)
    c, s = head_rows(*rope_rows(cos, sin, delta, dtype), num_heads // num_kv_heads)  # (B, NB, G, .)
    c, s = (t[:, None].expand(-1, num_kv_heads, -1, -1, -1).contiguous() for t in (c, s))
    mask = torch.arange(max_blocks * block_size, device=dev) < seq_lens[:, None]  # (B, L)
    return DecodePlan(rows, c, s, mask[:, None, None], workspace)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """One unrotated query per sequence: q (B, H, D) -> out (B, H, D)."""
    plan = decode_plan(block_tables, seq_lens, key_cache.shape[1], q.shape[1], key_cache.shape[2], cos, sin,
                       q.dtype)
    return decode(q, key_cache, value_cache, plan, scale, k_scale, v_scale, block_mass)


def decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
           scale: float, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None, block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode_attention` on a plan: the query rotated per block, scored against the stored keys.

    Grouped-query heads share their KV head: query head h = kv_head * G + g.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, max_blocks, group, _ = plan.q_cos.shape
    block_size = key_cache.shape[1]
    length = max_blocks * block_size
    k = gather_rows(key_cache, k_scale, plan.rows, q.dtype, plan.workspace, "key")  # (B*KVH*NB*BS, D)
    v = gather_rows(value_cache, v_scale, plan.rows, q.dtype, plan.workspace, "value")
    qg = q.view(num_seqs, num_kv_heads, 1, group, head_dim)
    qr = rotate(qg, plan.q_cos, plan.q_sin)  # (B, KVH, NB, G, D): the query as each block sees it
    s = torch.bmm(qr.view(-1, group, head_dim), k.view(-1, block_size, head_dim).transpose(1, 2))  # (., G, BS)
    s = s.view(num_seqs, num_kv_heads, max_blocks, group, block_size).transpose(2, 3)
    s = s.reshape(num_seqs, num_kv_heads, group, length)  # a copy: ours, in place from here
    probs = s.mul_(scale).masked_fill_(~plan.mask, float("-inf")).softmax(-1, dtype=torch.float32)
    if block_mass is not None:  # (B, KVH, G, NB * BS) -> (B, NB)
        block_mass[:, :max_blocks] += probs.view(num_seqs, num_kv_heads * group, max_blocks, block_size).sum((1, 3))
    out = torch.bmm(probs.to(q.dtype).view(-1, group, length), v.view(-1, length, head_dim))  # (B*KVH, G, D)
    return out.view(num_seqs, num_heads, head_dim)


# ---- prefill ----------------------------------------------------------------------------------


class PrefillSeq(NamedTuple):
    """One chunk with queries: q rows start..end, attending its sequence's first num_keys keys."""

    start: int
    end: int
    num_keys: int
    block_ids: torch.Tensor  # (num_blocks,) int64
    mask: torch.Tensor | None  # (n, num_keys) bool; None: nothing cached before the chunk (plain causal)
    index: int  # its row in the step's tables (a chunk without queries has none here)


class PrefillPlan(NamedTuple):
    """What every layer's prefill shares in a step."""

    seqs: list[PrefillSeq]
    q_cos: torch.Tensor  # (T, H, D) rows of each query's cache position
    q_sin: torch.Tensor  # (T, H, D // 2)
    k_cos: torch.Tensor  # (max_keys, KVH, D) rows of each key's block start
    k_sin: torch.Tensor  # (max_keys, KVH, D // 2)
    workspace: Workspace | None = None  # where each chunk's gathered (and rotated) keys and values go


def prefill_plan(block_tables: torch.Tensor, query_lens: list[int], key_lens: list[int], positions: torch.Tensor,
                 block_size: int, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 dtype: torch.dtype, workspace: Workspace | None = None) -> PrefillPlan:
    """Chunk b has query_lens[b] queries at the end of its key_lens[b] keys (host-side lists);
    positions (T,) are the queries' cache positions, chunk after chunk."""
    dev = block_tables.device
    seqs, start = [], 0
    for b, (n, num_keys) in enumerate(zip(query_lens, key_lens)):
        if n:
            mask = None
            if n < num_keys:  # query i at num_keys - n + i sees keys up to its position
                mask = torch.ones(n, num_keys, dtype=torch.bool, device=dev).tril_(num_keys - n)
            num_blocks = -(-num_keys // block_size)
            seqs.append(PrefillSeq(start, start + n, num_keys, block_tables[b, :num_blocks].long(), mask, b))
        start += n
    max_keys = max((s.num_keys for s in seqs), default=0)
    starts = torch.arange(max_keys, device=dev) // block_size * block_size
    return PrefillPlan(seqs, *head_rows(*rope_rows(cos, sin, positions, dtype), num_heads),
                       *head_rows(*rope_rows(cos, sin, starts, dtype), num_kv_heads), workspace)


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None,
                            block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen chunks of unrotated queries: q (T, H, D), sequence b's at q[cu[b]:cu[b+1]] -> out (T, H, D).

    Query i of a chunk of n sits at cache position seq_len - n + i and attends,
    causally, to every cached key at or before it (earlier blocks + the chunk).
    """
    query_lens = cu_seqlens_q.diff().tolist()  # the oracle may sync; the backend's plan comes from host lists
    key_lens = seq_lens.tolist()
    positions = torch.cat([torch.arange(k - n, k) for n, k in zip(query_lens, key_lens)]).to(q.device)
    plan = prefill_plan(block_tables, query_lens, key_lens, positions, key_cache.shape[1], q.shape[1],
                        key_cache.shape[2], cos, sin, q.dtype)
    return prefill(q, key_cache, value_cache, plan, scale, k_scale, v_scale, block_mass)


def prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: PrefillPlan,
            scale: float, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_prefill_attention` on a plan: keys rotated by block start, queries by position.

    Grouped-query heads share their KV head (`enable_gqa`): keys are never
    repeated per head. With `block_mass` the probabilities are needed, which
    `scaled_dot_product_attention` does not give: attention is computed
    explicitly (`attention_with_mass`).
    """
    block_size, num_kv_heads = key_cache.shape[1:3]
    head_dim = q.shape[-1]  # the pool's last dim is head_dim / 2 for int4
    out = torch.empty_like(q)
    qr = rotate(q, plan.q_cos, plan.q_sin)  # (T, H, D) by cache position
    for seq in plan.seqs:
        b = seq.index
        k, v = gather_blocks(key_cache, value_cache, seq.block_ids, k_scale, v_scale, q.dtype, plan.workspace)
        length = seq.num_keys
        k = rotate(k.view(-1, num_kv_heads, head_dim)[:length], plan.k_cos[:length], plan.k_sin[:length],
                   scratch(plan.workspace, "key.rotated", (length, num_kv_heads, head_dim), q.dtype, q.device))
        k = k.transpose(0, 1)[None]  # (1, KVH, L, D), now rotated by cache position
        v = v.view(-1, num_kv_heads, head_dim)[:length].transpose(0, 1)[None]
        qb = qr[seq.start:seq.end].transpose(0, 1)[None]  # (1, H, n, D)
        if block_mass is None:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=seq.mask, is_causal=seq.mask is None,
                                               scale=scale, enable_gqa=True)
        else:
            o, mass = attention_with_mass(qb, k, v, scale, block_size)
            block_mass[b, :mass.shape[0]] += mass
        out[seq.start:seq.end] = o[0].transpose(0, 1)  # (n, H, D)
    return out


def attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (1, H, n, D), the last n of k's (1, KVH, L, D) and v's (1, KVH, L, Dv)
    positions, and the mass per block of keys summed over heads and queries:
    ((1, H, n, Dv), (ceil(L / block_size),))."""
    _, num_heads, n, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = q[0].reshape(num_kv_heads, group * n, head_dim)  # head h = kv_head * G + g
    s = torch.bmm(qg, k[0].transpose(1, 2)).view(num_kv_heads, group, n, length)
    causal = torch.ones(n, length, dtype=torch.bool, device=q.device).tril_(length - n)
    probs = s.mul_(scale).masked_fill_(~causal, float("-inf")).softmax(-1, dtype=torch.float32)
    o = torch.bmm(probs.to(v.dtype).view(num_kv_heads, group * n, length), v[0])
    num_blocks = -(-length // block_size)
    mass = F.pad(probs.sum((0, 1, 2)), (0, num_blocks * block_size - length)).view(num_blocks, block_size).sum(1)
    return o.view(1, num_heads, n, v.shape[-1]), mass
