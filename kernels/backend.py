"""The Triton attention backend: `TorchBackend`'s interface over the kernels of this package.

Owns only the mapping from the runner's per-step metadata (DecodeGroup,
PrefillGroup) to kernel launches. Knows nothing about scheduling; holds no
state between steps: its step plan is the rope tables the kernels index
(they rotate in-kernel: keys on write by block offset, queries per block
in decode, queries and key tiles in prefill) and the decode split plan with
its partial-result buffers, made once and used by every layer.
k_scale/v_scale (None: float pool) pass through to the kernels for int8/fp8
pools.

MLA layers (a latent pool, `LatentKV`): decode by the MLA kernel
(mla_decode.py); the latent write and prefill, which may expand keys and
values from the latent but here attend in the absorbed form as well, run
the torch reference (mla_reference.py) on the device's tensors: SDPA per
chunk, the write one scatter a layer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from streamchat.kernels import mla_reference, reference
from streamchat.kernels.decode import DecodeSplits, paged_decode, plan_decode
from streamchat.kernels.mla_decode import paged_mla_decode
from streamchat.kernels.prefill import paged_prefill
from streamchat.kernels.write_kv import write_kv


class TritonDecode(NamedTuple):
    group: object  # DecodeGroup
    splits: DecodeSplits
    cos: torch.Tensor
    sin: torch.Tensor


class TritonPrefill:
    """A step's prefill: the group and rope tables the kernel reads, and for MLA layers the reference's
    plan (made on first use, from host-side lengths: no device sync)."""

    def __init__(self, group, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, block_size: int,
                 num_heads: int, dtype: torch.dtype) -> None:
        self.group, self.cos, self.sin = group, cos, sin
        self._args = (positions, block_size, num_heads, dtype)

    @functools.cached_property
    def latent_plan(self) -> reference.PrefillPlan:
        positions, block_size, num_heads, dtype = self._args
        g = self.group
        return reference.prefill_plan(g.block_tables, g.query_lens, g.key_lens, positions, block_size, num_heads, 1,
                                      self.cos, self.sin, dtype)


class TritonBackend:
    """Paged attention by Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def plan(self, meta, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
             heads) -> tuple:
        """(write, decode, prefill) parts of a step plan (see `attention.plan_step`)."""
        decode = prefill = None
        if meta.decode is not None:
            g = meta.decode
            splits = plan_decode(g.seq_lens.shape[0], heads.num_heads, heads.num_kv_heads, heads.head_dim,
                                 g.block_tables.shape[1], meta.block_size, g.seq_lens.device, dtype=dtype)
            decode = TritonDecode(g, splits, cos, sin)
        if meta.prefill is not None:
            prefill = TritonPrefill(meta.prefill, cos, sin, positions[meta.num_decode:], meta.block_size,
                                    heads.num_heads, dtype)
        return (cos, sin), decode, prefill

    def write(self, kv, key: torch.Tensor, value: torch.Tensor, plan) -> None:
        write_kv(kv.key, kv.value, key, value, plan.meta.slot_mapping, *plan.write, kv.k_scale, kv.v_scale)

    def decode(self, q: torch.Tensor, kv, plan, scale: float) -> torch.Tensor:
        g, splits, cos, sin = plan.decode
        return paged_decode(q, kv.key, kv.value, g.block_tables, g.seq_lens, cos, sin, scale,
                            kv.k_scale, kv.v_scale, splits=splits)

    def prefill(self, q: torch.Tensor, kv, plan, scale: float) -> torch.Tensor:
        p, g = plan.prefill, plan.prefill.group
        return paged_prefill(q, kv.key, kv.value, g.block_tables, g.seq_lens, g.cu_seqlens_q, p.cos, p.sin,
                             scale, kv.k_scale, kv.v_scale)

    def write_latent(self, kv, latent: torch.Tensor, plan) -> None:
        mla_reference.write_latent(kv.latent, latent, plan.meta.slot_mapping, *plan.write, kv.latent_scale)

    def decode_latent(self, q: torch.Tensor, kv, plan, scale: float) -> torch.Tensor:
        g, splits, cos, sin = plan.decode
        return paged_mla_decode(q, kv.latent, g.block_tables, g.seq_lens, cos, sin, scale, kv.latent_scale,
                                splits=splits)

    def prefill_latent(self, q: torch.Tensor, kv, plan, scale: float) -> torch.Tensor:
        return mla_reference.prefill(q, kv.latent, plan.prefill.latent_plan, scale, kv.latent_scale)
