"""Attention metadata for one step and the backend that consumes it.

Owns the shape of what the runner passes down to attention (an argument,
never a global) and the choice, made once at start-up, between the
pure-torch reference (CPU, and the oracle) and the Triton kernels (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from streamchat.kernels import reference


@dataclass
class DecodeGroup:
    """Sequences with exactly one query token this step: rows 0..Bd-1 of the flat batch."""

    block_tables: torch.Tensor  # (Bd, max_blocks) int32
    seq_lens: torch.Tensor  # (Bd,) int32


@dataclass
class PrefillGroup:
    """Sequences with a chunk of query tokens: rows Bd..T-1 of the flat batch, chunk by chunk."""

    cu_seqlens_q: torch.Tensor  # (Bp + 1,) int32, offsets within the prefill rows
    block_tables: torch.Tensor  # (Bp, max_blocks) int32
    seq_lens: torch.Tensor  # (Bp,) int32


class LayerKV(NamedTuple):
    """One layer's pool: (num_blocks, block_size, kv_heads, head_dim) key and value blocks,
    and their scales when the storage is quantized (None otherwise)."""

    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Decode rows come first in the flat batch, then the prefill chunks."""

    slot_mapping: torch.Tensor  # (T,) int64: where each token's K/V is written
    decode: DecodeGroup | None
    prefill: PrefillGroup | None


class TorchBackend:
    """The pure-torch reference backend."""

    name = "torch"

    def write(self, key_cache, value_cache, key, value, slot_mapping, k_scale=None, v_scale=None) -> None:
        reference.write_kv(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)

    def decode(self, q, key_cache, value_cache, group: DecodeGroup, cos, sin, scale,
               k_scale=None, v_scale=None):
        return reference.paged_decode_attention(
            q, key_cache, value_cache, group.block_tables, group.seq_lens, cos, sin, scale, k_scale, v_scale)

    def prefill(self, q, key_cache, value_cache, group: PrefillGroup, cos, sin, scale,
                k_scale=None, v_scale=None):
        return reference.paged_prefill_attention(
            q, key_cache, value_cache, group.block_tables, group.seq_lens,
            group.cu_seqlens_q, cos, sin, scale, k_scale, v_scale)


def make_backend(name: str, device: torch.device):
    """`auto`: Triton on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from streamchat.kernels.backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")


def attend(backend, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, cos: torch.Tensor,
           sin: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention for a flat batch q (T, H, D): decode rows, then prefill chunks."""
    parts = []
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
    num_decode = 0
    if meta.decode is not None:
        num_decode = meta.decode.seq_lens.shape[0]
        parts.append(backend.decode(q[:num_decode], kv.key, kv.value, meta.decode, cos, sin, scale, **scales))
    if meta.prefill is not None:
        parts.append(backend.prefill(q[num_decode:], kv.key, kv.value, meta.prefill, cos, sin, scale, **scales))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
