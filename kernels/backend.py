"""The Triton attention backend: `TorchBackend`'s interface over the kernels of this package.

Owns only the mapping from the runner's per-step metadata (DecodeGroup,
PrefillGroup) to kernel launches. Knows nothing about scheduling; holds no
state. k_scale/v_scale (None: float pool) pass through to the kernels for
int8/fp8 pools.
"""

from __future__ import annotations

import torch

from streamchat.kernels.decode import paged_decode
from streamchat.kernels.prefill import paged_prefill
from streamchat.kernels.write_kv import write_kv


class TritonBackend:
    """Paged attention by Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def write(self, key_cache, value_cache, key, value, slot_mapping, k_scale=None, v_scale=None) -> None:
        write_kv(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)

    def decode(self, q, key_cache, value_cache, group, cos, sin, scale,
               k_scale=None, v_scale=None) -> torch.Tensor:
        return paged_decode(q, key_cache, value_cache, group.block_tables, group.seq_lens, cos, sin, scale,
                            k_scale, v_scale)

    def prefill(self, q, key_cache, value_cache, group, cos, sin, scale,
                k_scale=None, v_scale=None) -> torch.Tensor:
        return paged_prefill(q, key_cache, value_cache, group.block_tables, group.seq_lens,
                             group.cu_seqlens_q, cos, sin, scale, k_scale, v_scale)
