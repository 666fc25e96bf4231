"""KV storage formats: quantize on write, dequantize on read (pure torch, the reference).

Formats, by the pool's storage dtype (keys are quantized BEFORE rotation):

    model dtype       no scales
    int8              symmetric, one float32 scale per token per KV head:
                      scale = max|x| / 127 (1 for an all-zero row),
                      q = round-half-away(x / scale) clamped to +-127
    float8_e4m3fn     one float32 scale per token per KV head, scale = max|x| / 448
    uint8 (int4)      two 4-bit codes a byte (low nibble = even index), asymmetric:
                      x = code * scale + min with code in [0, 15], scale = (max - min) / 15
                      (1 where max = min) and min in float16, one pair per group:
                      values per token per group of 32 along the head dimension;
                      keys per CHANNEL per block per KV head (KIVI: key outliers
                      live in channels, value outliers in tokens)

An MLA latent row (c, then the rotary key) is one "head" of latent_dim + rope_dim
values: int8/fp8 with two float32 scales a token (c's and the rotary part's),
int4 in groups of 32 as values are (`latent_scale_shape`).

Scale layouts (`scale_shapes`): int8/fp8 (num_blocks, block_size, num_kv_heads)
float32 for keys and values; int4 values (num_blocks, block_size, num_kv_heads,
head_dim // 32, 2) float16, int4 keys (num_blocks, num_kv_heads, head_dim, 2)
float16, the last dimension (scale, min). These match the Triton write kernel
for int8/fp8 exactly (Triton refuses int4).

Why asymmetric: a channel of keys over one block, or a group of a value row,
is rarely centred on zero, and a symmetric grid spends its levels on the side
the values do not reach. On the bundled model's real keys and values
(`python bench/kv_channels.py`) the min/max grid halves the key error of the
symmetric one per channel per block (6.3% -> 3.2% relative) and takes the
values' from 11.1% to 8.4%, for 4 more bytes a token per KV head per layer.

A block's per-channel key scale depends on all of its tokens, which arrive
over many steps (decode writes one a step). Each write into an int4 block
re-quantizes the whole block: its tokens so far are dequantized, joined by the
new ones, and quantized again under the range of the filled rows
(`requantize_block`). Where a channel's range does not grow its stored codes
come back exactly; where it grows they are rounded once more. A scale fixed at
the block's first write would clip every later token larger than the first
(see bench/kv_channels.py for the measured errors of both).
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
# Stored in the model's own dtype: "float" by name, and "auto" where no caller resolved it (a runner built
# straight from a config, as tests and tools build them; the daemon resolves it, streamchat.autotune).
UNQUANTIZED = ("float", "auto")


def scale_shape(kv_dtype: str, head_dim: int) -> tuple[int, ...]:
    """Trailing shape of a per-token scale tensor per slot and head: () or (head_dim // 32, 2)."""
    if kv_dtype == "int4":
        if head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        return (head_dim // INT4_GROUP, 2)
    return ()


def scale_shapes(kv_dtype: str, block_size: int, num_kv_heads: int,
                 head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the key and value scales per block (after num_blocks): int4 keys per channel."""
    value = (block_size, num_kv_heads, *scale_shape(kv_dtype, head_dim))
    return ((num_kv_heads, head_dim, 2) if kv_dtype == "int4" else value), value


def latent_scale_shape(kv_dtype: str, latent_dim: int, rope_dim: int) -> tuple[int, ...]:
    """Trailing shape of an MLA latent row's scales: int8/fp8 (2,), one for c and one for the rotary
    part (their ranges differ: c is normalized, k_rope is not); int4 (groups, 2) per group of 32."""
    if kv_dtype == "int4":
        if latent_dim % INT4_GROUP or rope_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs latent and rope dims divisible by {INT4_GROUP}, "
                             f"got {latent_dim} and {rope_dim}")
        return ((latent_dim + rope_dim) // INT4_GROUP, 2)
    return (2,)


def quantize_latent(x: torch.Tensor, storage: torch.dtype, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows x (..., latent_dim + rope_dim) -> (stored, scales) as `latent_scale_shape` lays them out."""
    if storage == torch.uint8:
        return quantize(x, storage)
    c, c_scale = quantize(x[..., :latent_dim], storage)
    r, r_scale = quantize(x[..., latent_dim:], storage)
    return torch.cat((c, r), dim=-1), torch.stack((c_scale, r_scale), dim=-1)


def dequantize_latent(q: torch.Tensor, scale: torch.Tensor, latent_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored latent rows and their scales -> (..., latent_dim + rope_dim) in `dtype`."""
    if q.dtype == torch.uint8:
        return dequantize(q, scale, dtype)
    x = q.float()
    x[..., :latent_dim] *= scale[..., :1]
    x[..., latent_dim:] *= scale[..., 1:]
    return x.to(dtype)


def storage_head_dim(kv_dtype: str, head_dim: int) -> int:
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def bytes_per_token(kv_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                    head_dim: int, block_size: int = 16) -> int:
    """Pool bytes one token takes across all layers, K and V, scales included (int4 keys'
    per-block scales spread over the block's tokens, rounded up to a whole byte)."""
    if kv_dtype in UNQUANTIZED:
        per_head = 2 * head_dim * torch.tensor([], dtype=model_dtype).element_size()
    elif kv_dtype == "int4":
        per_head = 2 * (head_dim // 2) + 4 * (head_dim // INT4_GROUP) + -(-4 * head_dim // block_size)
    else:
        per_head = 2 * (head_dim + 4)
    return num_layers * num_kv_heads * per_head


def quantize(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (stored values, scales) in the format of `storage`."""
    x = x.float()
    if storage == torch.uint8:
        return _quantize_int4(x)
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / Q_MAX[storage], torch.ones_like(amax))
    y = x / scale[..., None]
    if storage == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5)).clamp(-127, 127)
    return y.to(storage), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored values and scales -> (..., head_dim) in `dtype`, into `out` if given (int8/fp8)."""
    if q.dtype == torch.uint8:
        return _dequantize_int4(q, scale).to(dtype)
    if out is not None:  # the same float32 product, without a temporary (int8/fp8 -> out's dtype is exact)
        return out.copy_(q).mul_(scale[..., None])
    return (q.float() * scale[..., None]).to(dtype)


def per_channel(cache: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether `scale` holds per-channel block scales of `cache` (int4 keys): (N, KVH, D, 2) over uint8
    (N, bs, KVH, D // 2); int4 values' are (N, bs, KVH, D // 32, 2)."""
    return scale is not None and cache.dtype == torch.uint8 and scale.dim() == cache.dim()


def _grid(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(scale, min) pairs in float16 for ranges [lo, hi]: (..., 2). The min is rounded down and the
    scale up, so min + 15 * scale covers hi: no value of the range is clipped, and re-quantizing
    dequantized codes under a range that did not grow gives back the same pair and codes."""
    lo16 = lo.clamp(-65504, 65504).to(torch.float16)
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, torch.full_like(lo16, -65504)), lo16)
    s16 = ((hi - lo16.float()) / 15.0).to(torch.float16)
    short = s16.float() * 15.0 + lo16.float() < hi
    s16 = torch.where(short, torch.nextafter(s16, torch.full_like(s16, 65504)), s16)
    s16 = torch.where(s16 > 0, s16, torch.ones_like(s16))  # a single value: code 0 is the min itself
    return torch.stack((s16, lo16), dim=-1)


def _codes(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Unrounded x -> codes in [0, 15] under float16 (scale, min) pairs broadcast against x."""
    g = grid.float()
    y = (x - g[..., 1]) / g[..., 0]
    return torch.floor(y + 0.5).clamp(0, 15)


def quantize_channels(x: torch.Tensor, filled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 keys of whole blocks, one (scale, min) per channel per block and head.

    x (N, block_size, KVH, D) float, filled (N, block_size) bool: the rows that
    hold tokens (the others are ignored and stored as code 0) ->
    (stored (N, block_size, KVH, D // 2) uint8, grid (N, KVH, D, 2) float16).
    """
    x = x.float()
    rows = filled[:, :, None, None]
    lo = torch.where(rows, x, float("inf")).amin(dim=1)  # (N, KVH, D)
    hi = torch.where(rows, x, float("-inf")).amax(dim=1)
    empty = ~filled.any(dim=1)[:, None, None]
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    grid = _grid(lo, hi)
    codes = torch.where(rows, _codes(x, grid[:, None]), 0.0)
    return _pack_int4(codes), grid


def dequantize_channels(q: torch.Tensor, grid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored int4 keys q (N, L, ..., D // 2) and their channel grid (N, ..., D, 2) -> (N, L, ..., D)."""
    g = grid.float().unsqueeze(1)
    return (_unpack_int4(q) * g[..., 0] + g[..., 1]).to(dtype)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes (..., D) in [0, 15] (float) -> two nibbles a byte (..., D // 2)."""
    y = codes.to(torch.uint8)
    return y[..., 0::2] | (y[..., 1::2] << 4)


def _unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., D // 2) uint8 -> (..., D) float32 codes in [0, 15]."""
    *lead, half = q.shape
    low = (q & 0x0F).float()
    high = (q >> 4).float()
    return torch.stack((low, high), dim=-1).view(*lead, 2 * half)


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, d = x.shape
    groups = x.view(*lead, d // INT4_GROUP, INT4_GROUP)
    grid = _grid(groups.amin(dim=-1), groups.amax(dim=-1))  # (..., D // 32, 2)
    return _pack_int4(_codes(groups, grid[..., None, :]).view(*lead, d)), grid


def _dequantize_int4(q: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    y = _unpack_int4(q)
    *lead, d = y.shape
    groups = y.view(*lead, d // INT4_GROUP, INT4_GROUP)
    g = grid.float()[..., None, :]
    return (groups * g[..., 0] + g[..., 1]).view(*lead, d)
