"""The CPU MLA decode kernel (cpu_mla.c, built into `cpu`'s library): the latent read where it lies.

`mla_reference.decode` gathers every sequence's latent rows into a workspace
per layer and multiplies there; this kernel walks the block tables and reads
each row once for all heads. The reference stays the oracle: the tests hold
the kernel to it, and quantized latents (or a machine without a compiler)
run the reference.
"""

from __future__ import annotations

import torch

from streamchat.kernels import cpu

MAX_HEADS, MAX_WIDTH, MAX_ROPE = 128, 1024, 128  # the kernel's fixed arrays (cpu_mla.c)


def supports(latent_cache: torch.Tensor, latent_scale: torch.Tensor | None, num_heads: int, rope_dim: int) -> bool:
    """Whether the kernel reads this pool and shape: an unquantized contiguous float pool on the CPU."""
    width = latent_cache.shape[-1]
    return (latent_scale is None and latent_cache.device.type == "cpu" and latent_cache.dtype in cpu.DTYPES
            and latent_cache.is_contiguous() and num_heads <= MAX_HEADS and width <= MAX_WIDTH
            and rope_dim <= MAX_ROPE and (width - rope_dim) % 16 == 0 and rope_dim % 8 == 0
            and latent_cache.shape[1] <= cpu.RUN_TOKENS and cpu.library() is not None)


def scratch_sizes(num_seqs: int, num_heads: int, latent_dim: int, max_blocks: int,
                  block_size: int) -> tuple[int, int]:
    """Floats of `partial` and of `stats` (used only with block_mass) for a step's shape."""
    runs = -(-max_blocks // cpu.chunk_blocks(block_size))
    return num_seqs * runs * num_heads * (latent_dim + 2), num_seqs * num_heads * max_blocks * 2


def paged_mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                     block_mass: torch.Tensor | None = None, partial: torch.Tensor | None = None,
                     stats: torch.Tensor | None = None) -> torch.Tensor:
    """mla_reference.paged_mla_decode for a pool `supports` takes: q (B, H, C + R) -> (B, H, C) in q's dtype.

    block_tables and seq_lens contiguous int32, cos/sin (max_pos, R) contiguous float32; `partial` and
    `stats` float32 scratch of at least `scratch_sizes` (allocated here when None).
    """
    num_seqs, num_heads, width = q.shape
    _, block_size, _ = latent_cache.shape
    rope_dim = cos.shape[1]
    latent_dim, max_blocks = width - rope_dim, block_tables.shape[1]
    cpu.check_step(block_tables, seq_lens, cos, sin)
    if not supports(latent_cache, None, num_heads, rope_dim) or latent_cache.shape[-1] != width:
        raise ValueError(f"the CPU MLA kernel does not read a {latent_cache.dtype} pool of {tuple(latent_cache.shape)}")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(num_seqs, num_heads, latent_dim, dtype=torch.float32)
    n_partial, n_stats = scratch_sizes(num_seqs, num_heads, latent_dim, max_blocks, block_size)
    if partial is None or partial.numel() < n_partial:
        partial = torch.empty(n_partial, dtype=torch.float32)
    mass_ptr, mass_stride, stats = cpu.mass_scratch(block_mass, num_seqs, max_blocks, stats, n_stats)
    rc = cpu.library().mla_decode(
        qf.data_ptr(), latent_cache.data_ptr(), cpu.DTYPES[latent_cache.dtype], block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), mass_ptr,
        mass_stride, partial.data_ptr(), None if stats is None else stats.data_ptr(), num_seqs, num_heads,
        latent_dim, rope_dim, block_size, max_blocks, cpu.chunk_blocks(block_size), float(scale))
    if rc != 0:
        raise ValueError(f"the CPU MLA kernel does not take {num_heads} heads of {latent_dim} + {rope_dim}")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
