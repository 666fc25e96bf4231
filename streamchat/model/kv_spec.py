"""What a layer's KV cache holds: one frozen spec per layer (vLLM's KVCacheSpec), and pools made from it.

Owns, for each kind of attention, the tensors one block holds (names,
dtypes, shapes) under each KV storage format (`--kv-dtype`), bytes per
token and per block, allocating a pool, and the description a KV file
records. The runner's pool, the host tier, the KV file and the stats size
themselves from these; a new architecture brings a spec and a model class.

    FullAttentionSpec  keys and values per KV head (MHA, GQA, MQA):
        key, value        (block_size, num_kv_heads, head_dim*)   model dtype, or int8 / fp8 / int4 codes
        k_scale, v_scale  quantized formats only (layouts in kernels/quant.py)
    MLAAttentionSpec   one latent row per token (multi-head latent attention, DeepSeek-V2/V3):
        latent            (block_size, latent_dim + rope_dim*)     [ c | R(offset) k_rope ]
        latent_scale      int8 / fp8: (block_size, 2) float32, one scale for c and one for k_rope;
                          int4: (block_size, width // 32, 2) float16, (scale, min) per group of 32
    * halved for int4 (two codes a byte)

Pools are NamedTuples whose field names are the tensor names (`LayerKV`,
`LatentKV`), so code that moves blocks walks `zip(kv._fields, kv)` and
needs no kind. Knows nothing about models, sessions or attention math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from streamchat.kernels import quant
from streamchat.model.attention import LatentKV, LayerKV


class TensorSpec(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # one block's, after the leading num_blocks
    fill: float = 0.0  # scales start at 1


class KVSpec:
    """The parts every spec shares; subclasses give `tensors`, `describe` and their pool type."""

    kind: ClassVar[str]
    pool: ClassVar[type]
    block_size: int
    kv_dtype: str

    def tensors(self) -> tuple[TensorSpec, ...]:
        raise NotImplementedError

    def describe(self) -> dict:
        """The shape fields a KV file records (block size and dtypes are layout fields of their own)."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes, scales included."""
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors())

    @property
    def bytes_per_token(self) -> int:
        return -(-self.page_size_bytes // self.block_size)

    def allocate(self, num_blocks: int, device: torch.device, pin_memory: bool = False, fill: bool = True):
        """A pool of `num_blocks` blocks: values zero and scales one, or left as allocated (`fill`
        False: a host tier's, whose blocks are always copied into before they are read)."""
        made = []
        for t in self.tensors():
            x = torch.empty((num_blocks, *t.shape), dtype=t.dtype, device=device, pin_memory=pin_memory)
            made.append(x.fill_(t.fill) if fill else x)
        return self.pool(*made)


def _scale_dtype(kv_dtype: str) -> torch.dtype:
    return torch.float16 if kv_dtype == "int4" else torch.float32


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """Keys and values per KV head; quantized keys and values share the formats of kernels/quant.py."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: the storage of an unquantized pool
    kv_dtype: str = "auto"
    kind: ClassVar[str] = "full_attention"
    pool: ClassVar[type] = LayerKV

    def tensors(self) -> tuple[TensorSpec, ...]:
        lead = (self.block_size, self.num_kv_heads)
        if self.kv_dtype in quant.UNQUANTIZED:
            return (TensorSpec("key", self.dtype, (*lead, self.head_dim)),
                    TensorSpec("value", self.dtype, (*lead, self.head_dim)))
        storage = quant.STORAGE[self.kv_dtype]
        width = quant.storage_head_dim(self.kv_dtype, self.head_dim)
        k_shape, v_shape = quant.scale_shapes(self.kv_dtype, *lead, self.head_dim)
        scale = _scale_dtype(self.kv_dtype)
        return (TensorSpec("key", storage, (*lead, width)), TensorSpec("value", storage, (*lead, width)),
                TensorSpec("k_scale", scale, k_shape, 1.0), TensorSpec("v_scale", scale, v_shape, 1.0))

    @property
    def bytes_per_token(self) -> int:
        """As kernels/quant.py counts it: int4 keys' per-block scales rounded up per KV head."""
        return quant.bytes_per_token(self.kv_dtype, self.dtype, 1, self.num_kv_heads, self.head_dim,
                                     self.block_size)

    def describe(self) -> dict:
        return {"kind": self.kind, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


@dataclass(frozen=True)
class MLAAttentionSpec(KVSpec):
    """One latent row a token: the compressed KV c (latent_dim) and the shared rotary key (rope_dim)."""

    block_size: int
    latent_dim: int  # kv_lora_rank
    rope_dim: int  # qk_rope_head_dim
    dtype: torch.dtype
    kv_dtype: str = "auto"
    kind: ClassVar[str] = "mla"
    pool: ClassVar[type] = LatentKV

    @property
    def width(self) -> int:
        return self.latent_dim + self.rope_dim

    def tensors(self) -> tuple[TensorSpec, ...]:
        if self.kv_dtype in quant.UNQUANTIZED:
            return (TensorSpec("latent", self.dtype, (self.block_size, self.width)),)
        storage = quant.STORAGE[self.kv_dtype]
        width = quant.storage_head_dim(self.kv_dtype, self.width)
        scale = quant.latent_scale_shape(self.kv_dtype, self.latent_dim, self.rope_dim)
        return (TensorSpec("latent", storage, (self.block_size, width)),
                TensorSpec("latent_scale", _scale_dtype(self.kv_dtype), (self.block_size, *scale), 1.0))

    def describe(self) -> dict:
        return {"kind": self.kind, "latent_dim": self.latent_dim, "rope_dim": self.rope_dim}


def bytes_per_token(specs) -> int:
    """Pool bytes one token takes across all layers."""
    return sum(s.bytes_per_token for s in specs)
