"""KV storage formats: quantize on write, dequantize on read (pure torch, the reference).

Formats, by the pool's storage dtype (keys are quantized BEFORE rotation):

    model dtype       no scales
    int8              symmetric, one float32 scale per token per KV head:
                      scale = max|x| / 127 (1 for an all-zero row),
                      q = round-half-away(x / scale) clamped to +-127
    float8_e4m3fn     one float32 scale per token per KV head, scale = max|x| / 448
    uint8 (int4)      two 4-bit values a byte (low nibble = even index), symmetric
                      in [-7, 7] stored as q + 8; one float16 scale per group of
                      32 along the head dimension: scale = max|x| / 7

Scale layouts: int8/fp8 (num_blocks, block_size, num_kv_heads) float32;
int4 (num_blocks, block_size, num_kv_heads, head_dim // 32) float16.
These match the Triton write kernel for int8/fp8 exactly.
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def scale_shape(kv_dtype: str, head_dim: int) -> tuple[int, ...]:
    """Trailing shape of a scale tensor per slot and head: () or (head_dim // 32,)."""
    if kv_dtype == "int4":
        if head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {head_dim}")
        return (head_dim // INT4_GROUP,)
    return ()


def storage_head_dim(kv_dtype: str, head_dim: int) -> int:
    return head_dim // 2 if kv_dtype == "int4" else head_dim


def bytes_per_token(kv_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                    head_dim: int) -> int:
    """Pool bytes one token takes across all layers, K and V, scales included."""
    if kv_dtype == "auto":
        per_head = head_dim * torch.tensor([], dtype=model_dtype).element_size()
    elif kv_dtype == "int4":
        per_head = head_dim // 2 + 2 * (head_dim // INT4_GROUP)
    else:
        per_head = head_dim + 4
    return 2 * num_layers * num_kv_heads * per_head


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


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, d = x.shape
    groups = x.view(*lead, d // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(torch.float16)
    y = groups / scale.float()[..., None]
    y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5)).clamp(-7, 7) + 8
    y = y.view(*lead, d).to(torch.uint8)
    return y[..., 0::2] | (y[..., 1::2] << 4), scale


def _dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    *lead, half = q.shape
    low = (q & 0x0F).float() - 8
    high = (q >> 4).float() - 8
    y = torch.stack((low, high), dim=-1).view(*lead, 2 * half)
    groups = y.view(*lead, 2 * half // INT4_GROUP, INT4_GROUP)
    return (groups * scale.float()[..., None]).view(*lead, 2 * half)
