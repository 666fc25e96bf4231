"""KV storage formats: quantize on write, dequantize on read (pure torch, the reference).

Formats, by the pool's storage dtype (keys are quantized BEFORE rotation):

    model dtype       no scales
    int8              symmetric, one float32 scale per token per KV head:
                      scale = max|x| / 127 (1 for an all-zero row),
                      q = round-half-away(x / scale) clamped to +-127
    float8_e4m3fn     one float32 scale per token per KV head, scale = max|x| / 448
    uint8 (int4)      two 4-bit values a byte (low nibble = even index), symmetric
                      in [-7, 7] stored as q + 8, float16 scales = max|x| / 7:
                      values one scale per token per group of 32 along the head
                      dimension; keys one scale per CHANNEL per block per KV head
                      (KIVI: key outliers live in channels, value outliers in tokens)

Scale layouts (`scale_shapes`): int8/fp8 (num_blocks, block_size, num_kv_heads)
float32 for keys and values; int4 values (num_blocks, block_size, num_kv_heads,
head_dim // 32) float16, int4 keys (num_blocks, num_kv_heads, head_dim) float16.
These match the Triton write kernel for int8/fp8 exactly (Triton refuses int4).

A block's per-channel key scale depends on all of its tokens, which arrive
over many steps (decode writes one a step). Each write into an int4 block
re-quantizes the whole block: its tokens so far are dequantized, joined by the
new ones, and quantized again under the max over the filled rows
(`requantize_block`). Where a channel's max does not grow its stored values
come back exactly; where it grows they are rounded once more. A scale fixed at
the block's first write would clip every later token larger than the first
(see bench/kv_channels.py for the measured errors of both).
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def scale_shape(kv_dtype: str, head_dim: int) -> tuple[int, ...]:
    """Trailing shape of a per-token scale tensor per slot and head: () or (head_dim // 32,)."""
    if kv_dtype == "int4":
        if head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        return (head_dim // INT4_GROUP,)
    return ()


def scale_shapes(kv_dtype: str, block_size: int, num_kv_heads: int,
                 head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the key and value scales per block (after num_blocks): int4 keys per channel."""
    value = (block_size, num_kv_heads, *scale_shape(kv_dtype, head_dim))
    return ((num_kv_heads, head_dim) if kv_dtype == "int4" else value), value


def storage_head_dim(kv_dtype: str, head_dim: int) -> int:
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def bytes_per_token(kv_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                    head_dim: int, block_size: int = 16) -> int:
    """Pool bytes one token takes across all layers, K and V, scales included (int4 keys'
    per-block scales spread over the block's tokens, rounded up to a whole byte)."""
    if kv_dtype == "auto":
        per_head = 2 * head_dim * torch.tensor([], dtype=model_dtype).element_size()
    elif kv_dtype == "int4":
        per_head = 2 * (head_dim // 2) + 2 * (head_dim // INT4_GROUP) + -(-2 * head_dim // block_size)
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
    """Whether `scale` holds per-channel block scales of `cache` (int4 keys): (N, KVH, D) over uint8."""
    return scale is not None and cache.dtype == torch.uint8 and scale.dim() == cache.dim() - 1


def quantize_channels(x: torch.Tensor, filled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 keys of whole blocks, one scale per channel per block and head.

    x (N, block_size, KVH, D) float, filled (N, block_size) bool: the rows that
    hold tokens (the others are ignored and stored as zeros) ->
    (stored (N, block_size, KVH, D // 2) uint8, scales (N, KVH, D) float16).
    """
    x = torch.where(filled[:, :, None, None], x.float(), 0.0)
    amax = x.abs().amax(dim=1)  # (N, KVH, D)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(torch.float16)
    return _pack_int4(x / scale.float()[:, None]), scale


def dequantize_channels(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored int4 keys q (N, L, ..., D // 2) and their channel scales (N, ..., D) -> (N, L, ..., D)."""
    return (_unpack_int4(q) * scale.float().unsqueeze(1)).to(dtype)


def _round_int4(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5)).clamp(-7, 7)


def _pack_int4(y: torch.Tensor) -> torch.Tensor:
    """Unrounded quotients (..., D) -> two nibbles a byte (..., D // 2), q + 8."""
    y = (_round_int4(y) + 8).to(torch.uint8)
    return y[..., 0::2] | (y[..., 1::2] << 4)


def _unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., D // 2) uint8 -> (..., D) float32 in [-7, 7] (the stored q, no scale)."""
    *lead, half = q.shape
    low = (q & 0x0F).float() - 8
    high = (q >> 4).float() - 8
    return torch.stack((low, high), dim=-1).view(*lead, 2 * half)


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, d = x.shape
    groups = x.view(*lead, d // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(torch.float16)
    return _pack_int4((groups / scale.float()[..., None]).view(*lead, d)), scale


def _dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = _unpack_int4(q)
    *lead, d = y.shape
    groups = y.view(*lead, d // INT4_GROUP, INT4_GROUP)
    return (groups * scale.float()[..., None]).view(*lead, d)
