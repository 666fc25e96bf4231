"""Attention metadata for one step, the plan its layers share, and the backend that consumes them.

Owns the shape of what the runner passes down to attention (an argument,
never a global), the choice, made once at start-up, among the pure-torch
reference (the oracle), the CPU backend (the reference with decode attention
and the KV write by C kernels) and the Triton kernels (CUDA), and the
per-step plan: everything the same for all layers (tables, lengths, rope
rows, masks, the split of the chunks, the decode kernels' split buffers) is
made once by the backend's `plan` and handed to every layer; buffers that
outlive a step (the torch backend's gather workspace) belong to the backend.
A step that wants attention mass (h2o eviction) carries a `block_mass`
accumulator in its plan, (chunks, max_blocks) float32: every layer's
attention adds its probabilities per block into it (decode rows first).
The torch and cpu backends fill it; the Triton backend refuses such a step.

Two kinds of pool, by their layer's KV spec: keys and values per KV head
(`LayerKV`: `write`, `decode`, `prefill`) and MLA's latent rows (`LatentKV`:
`write_latent`, `decode_latent`, `prefill_latent`, on a plan made for one KV
head over the rotary dims); `attend` picks by the pool's type.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from streamchat.kernels import cpu, cpu_mla, mla_reference, reference


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
    query_lens: list[int]  # host copies of the chunk sizes and seq_lens: a plan needs no device sync
    key_lens: list[int]


class LayerKV(NamedTuple):
    """One layer's pool: (num_blocks, block_size, kv_heads, head_dim) key and value blocks,
    and their scales when the storage is quantized (None otherwise)."""

    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class LatentKV(NamedTuple):
    """One MLA layer's pool: (num_blocks, block_size, latent_dim + rope_dim) latent rows, and their
    scales when quantized (None otherwise); see kernels/mla_reference.py."""

    latent: torch.Tensor
    latent_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Decode rows come first in the flat batch, then the prefill chunks."""

    slot_mapping: torch.Tensor  # (T,) int64: where each token's K/V is written
    block_size: int
    decode: DecodeGroup | None
    prefill: PrefillGroup | None

    @property
    def num_decode(self) -> int:
        return 0 if self.decode is None else self.decode.seq_lens.shape[0]


class Heads(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


class StepPlan(NamedTuple):
    """What every layer of a step shares; `write`, `decode`, `prefill` are the backend's own."""

    meta: AttentionMetadata
    write: object
    decode: object | None
    prefill: object | None
    block_mass: torch.Tensor | None = None  # (chunks, max_blocks) float32, added to by every layer


class TorchBackend:
    """The pure-torch reference backend.

    Owns one scratch workspace for the blocks attention gathers, reused by
    every layer and step (see `reference.Workspace`): the only state it keeps.
    """

    name = "torch"
    computes_mass = True  # fills a step's block_mass (h2o eviction)

    def __init__(self) -> None:
        self.workspace = reference.Workspace()

    def plan(self, meta: AttentionMetadata, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             dtype: torch.dtype, heads: Heads) -> tuple:
        """(write, decode, prefill) parts of a step plan: rope rows (write offsets, decode per block,
        prefill positions and block starts), masks, the host-side split of the chunks."""
        bs = meta.block_size
        key_cos, key_sin = reference.rope_rows(cos, sin, meta.slot_mapping % bs, torch.float32)
        decode = prefill = None
        if meta.decode is not None:
            decode = self.decode_plan(meta.decode, bs, cos, sin, dtype, heads)
        if meta.prefill is not None:
            g = meta.prefill
            prefill = reference.prefill_plan(g.block_tables, g.query_lens, g.key_lens,
                                             positions[meta.num_decode:], bs, heads.num_heads,
                                             heads.num_kv_heads, cos, sin, dtype, self.workspace)
        return (key_cos[:, None], key_sin[:, None]), decode, prefill

    def decode_plan(self, g: DecodeGroup, block_size: int, cos: torch.Tensor, sin: torch.Tensor,
                    dtype: torch.dtype, heads: Heads):
        return reference.decode_plan(g.block_tables, g.seq_lens, block_size, heads.num_heads, heads.num_kv_heads,
                                     cos, sin, dtype, self.workspace)

    def write(self, kv: LayerKV, key: torch.Tensor, value: torch.Tensor, plan: StepPlan) -> None:
        reference.store_kv(kv.key, kv.value, key, value, plan.meta.slot_mapping, *plan.write,
                           kv.k_scale, kv.v_scale)

    def decode(self, q: torch.Tensor, kv: LayerKV, plan: StepPlan, scale: float) -> torch.Tensor:
        return reference.decode(q, kv.key, kv.value, plan.decode, scale, kv.k_scale, kv.v_scale, decode_mass(plan))

    def prefill(self, q: torch.Tensor, kv: LayerKV, plan: StepPlan, scale: float) -> torch.Tensor:
        return reference.prefill(q, kv.key, kv.value, plan.prefill, scale, kv.k_scale, kv.v_scale,
                                 prefill_mass(plan))

    # MLA: one latent row a token (see kernels/mla_reference.py); the plan is made for one KV head

    def write_rows(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The write's rotation rows: (T, 1, R), (T, 1, R // 2)."""
        return plan.write

    def write_latent(self, kv: LatentKV, latent: torch.Tensor, plan: StepPlan) -> None:
        rope_cos, rope_sin = self.write_rows(plan)
        mla_reference.store_latent(kv.latent, latent, plan.meta.slot_mapping, rope_cos[:, 0], rope_sin[:, 0],
                                   kv.latent_scale)

    def decode_latent(self, q: torch.Tensor, kv: LatentKV, plan: StepPlan, scale: float) -> torch.Tensor:
        return mla_reference.decode(q, kv.latent, self.reference_decode(plan), scale, kv.latent_scale,
                                    decode_mass(plan))

    def reference_decode(self, plan: StepPlan) -> reference.DecodePlan:
        return plan.decode

    def prefill_latent(self, q: torch.Tensor, kv: LatentKV, plan: StepPlan, scale: float) -> torch.Tensor:
        return mla_reference.prefill(q, kv.latent, plan.prefill, scale, kv.latent_scale, prefill_mass(plan))


def decode_mass(plan: StepPlan) -> torch.Tensor | None:
    """The decode rows' part of the step's attention-mass accumulator (None: not wanted)."""
    return None if plan.block_mass is None else plan.block_mass[:plan.meta.num_decode]


def prefill_mass(plan: StepPlan) -> torch.Tensor | None:
    return None if plan.block_mass is None else plan.block_mass[plan.meta.num_decode:]


class CpuDecode:
    """A decode plan of the C kernel: the group's tables and lengths as int32, the rope tables, and
    the reference's plan, built only if a layer's pool is one the kernel does not read (int4)."""

    def __init__(self, group: DecodeGroup, cos: torch.Tensor, sin: torch.Tensor, reference_plan) -> None:
        self.tables = group.block_tables.to(torch.int32).contiguous()
        self.seq_lens = group.seq_lens.to(torch.int32).contiguous()
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        self._reference_plan = reference_plan

    @functools.cached_property
    def reference(self) -> reference.DecodePlan:
        return self._reference_plan()


# Prefill chunks of up to this many tokens go to the C decode kernel, one decode row per query (its own
# length: the keys up to its position). A question of 30 tokens against 2,300 cached ones spent a third of
# its attention in the reference's gather and rotation of every key before scaled_dot_product_attention;
# row by row the kernel reads the keys in place: a step of 16 decode rows and that chunk 171-192 -> 139-165
# ms (2-core EPYC, int8 pool). Its rows cost what a decode row costs, so long chunks stay the reference's.
SHORT_PREFILL_TOKENS = 64


def short_prefill(g: PrefillGroup | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each query row's block table (rows, max blocks) and length (its cache position + 1) as int32, when
    every chunk of the step's prefill is short; else None. positions: the prefill rows' cache positions."""
    if g is None or not any(g.query_lens) or max(g.query_lens) > SHORT_PREFILL_TOKENS:
        return None
    tables = g.block_tables.to(torch.int32).repeat_interleave(torch.tensor(g.query_lens), dim=0)
    return tables.contiguous(), (positions + 1).to(torch.int32)


class CpuBackend(TorchBackend):
    """The torch backend with decode attention and the KV write by the C kernels (kernels/cpu_decode.c,
    MLA decode kernels/cpu_mla.c):
    decode reads the pool's blocks in place instead of gathering them, float pools and int8/fp8 ones (with
    a scale per token per KV head) alike; the write too, into float and int8 pools. Prefill attention,
    int4 pools and the write into fp8 and int4 pools are the reference's. The kernels are held to the
    reference by the tests."""

    name = "cpu"

    def plan(self, meta: AttentionMetadata, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             dtype: torch.dtype, heads: Heads) -> tuple:
        """The torch backend's plan, with the rope tables beside the write's rows (the C write reads them),
        and each query row's table and length when every prefill chunk is short (`short_prefill`)."""
        write, decode, prefill = super().plan(meta, positions, cos, sin, dtype, heads)
        short = short_prefill(meta.prefill, positions[meta.num_decode:])
        return (write, cos.float().contiguous(), sin.float().contiguous(), short), decode, prefill

    def write_rows(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        return plan.write[0]

    def reference_decode(self, plan: StepPlan) -> reference.DecodePlan:
        return plan.decode.reference

    def prefill(self, q: torch.Tensor, kv: LayerKV, plan: StepPlan, scale: float) -> torch.Tensor:
        """Short chunks by the decode kernel, each query row as a decode row of its own length; the rest
        (long chunks, attention mass, pools or shapes the kernel does not take) by the reference."""
        _, cos, sin, rows = plan.write
        if (rows is None or prefill_mass(plan) is not None or not cpu.supports(kv.key, kv.k_scale, q.shape[-1])
                or not cpu.fits(q.shape[1], kv.key.shape[2], q.shape[2], kv.key.shape[1])):
            return super().prefill(q, kv, plan, scale)
        tables, lens = rows
        n_partial, _ = cpu.scratch_sizes(q.shape[0], q.shape[1], kv.key.shape[2], q.shape[2], tables.shape[1],
                                         kv.key.shape[1])
        partial = self.workspace.take("cpu.partial", (n_partial,), torch.float32, q.device)
        return cpu.paged_decode(q, kv.key, kv.value, tables, lens, cos, sin, scale, None, partial, None,
                                kv.k_scale, kv.v_scale)

    def write(self, kv: LayerKV, key: torch.Tensor, value: torch.Tensor, plan: StepPlan) -> None:
        rows, cos, sin, _ = plan.write
        if cpu.writes(kv.key, kv.k_scale, key.shape[-1]):
            cpu.write_kv(kv.key, kv.value, key, value, plan.meta.slot_mapping, cos, sin, kv.k_scale, kv.v_scale)
        else:
            reference.store_kv(kv.key, kv.value, key, value, plan.meta.slot_mapping, *rows, kv.k_scale, kv.v_scale)

    def decode_plan(self, g: DecodeGroup, block_size: int, cos: torch.Tensor, sin: torch.Tensor,
                    dtype: torch.dtype, heads: Heads) -> CpuDecode:
        return CpuDecode(g, cos, sin, lambda: super(CpuBackend, self).decode_plan(g, block_size, cos, sin, dtype,
                                                                                   heads))

    def decode(self, q: torch.Tensor, kv: LayerKV, plan: StepPlan, scale: float) -> torch.Tensor:
        mass = decode_mass(plan)
        d = plan.decode
        if not (cpu.supports(kv.key, kv.k_scale, q.shape[-1])
                and cpu.fits(q.shape[1], kv.key.shape[2], q.shape[2], kv.key.shape[1])):
            return reference.decode(q, kv.key, kv.value, d.reference, scale, kv.k_scale, kv.v_scale, mass)
        shape = (q.shape[0], q.shape[1], kv.key.shape[2], q.shape[2], d.tables.shape[1], kv.key.shape[1])
        n_partial, n_stats = cpu.scratch_sizes(*shape)
        partial = self.workspace.take("cpu.partial", (n_partial,), torch.float32, q.device)
        stats = None if mass is None else self.workspace.take("cpu.stats", (n_stats,), torch.float32, q.device)
        return cpu.paged_decode(q, kv.key, kv.value, d.tables, d.seq_lens, d.cos, d.sin, scale, mass,
                                partial, stats, kv.k_scale, kv.v_scale)

    def decode_latent(self, q: torch.Tensor, kv: LatentKV, plan: StepPlan, scale: float) -> torch.Tensor:
        """MLA decode by the C kernel (cpu_mla.c: 1.7 to 2.3 times the reference's speed at 1 and 16
        sessions of 512 and 2048 tokens, `bench/mla.py --part kernels`); quantized latents by the reference."""
        d = plan.decode
        if not cpu_mla.supports(kv.latent, kv.latent_scale, q.shape[1], d.cos.shape[1]):
            return super().decode_latent(q, kv, plan, scale)
        mass = decode_mass(plan)
        n_partial, n_stats = cpu_mla.scratch_sizes(q.shape[0], q.shape[1], q.shape[2] - d.cos.shape[1],
                                                   d.tables.shape[1], kv.latent.shape[1])
        partial = self.workspace.take("cpu.partial", (n_partial,), torch.float32, q.device)
        stats = None if mass is None else self.workspace.take("cpu.stats", (n_stats,), torch.float32, q.device)
        return cpu_mla.paged_mla_decode(q, kv.latent, d.tables, d.seq_lens, d.cos, d.sin, scale, mass, partial,
                                        stats)


def make_backend(name: str, device: torch.device):
    """`auto`: Triton on CUDA; on CPU the C decode kernel when it builds, else the torch reference."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if cpu.library() is not None else "torch"
    if name == "cpu":
        if device.type != "cpu" or cpu.library() is None:
            raise ValueError("--attention-backend cpu needs a CPU device and a C compiler (cc) to build its "
                             "decode kernel; use torch")
        return CpuBackend()
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from streamchat.kernels.backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, cpu, torch or triton")


def plan_step(backend, meta: AttentionMetadata, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              dtype: torch.dtype, heads: Heads, block_mass: torch.Tensor | None = None) -> StepPlan:
    """The step's plan, made once and handed to every layer's `write` and `attend`.

    positions (T,) are the tokens' cache positions; cos/sin (max_pos, D) the
    model's float32 rotary tables; dtype the model's; block_mass an accumulator
    for attention mass per chunk and table index (None: not wanted).
    """
    if block_mass is not None and not getattr(backend, "computes_mass", False):
        raise ValueError(f"attention mass per block (h2o eviction) is computed by the cpu and torch "
                         f"attention backends, not {backend.name!r}; use --attention-backend cpu or torch, "
                         f"or --eviction sink_window")
    return StepPlan(meta, *backend.plan(meta, positions, cos, sin, dtype, heads), block_mass)


def attend(backend, q: torch.Tensor, kv: LayerKV | LatentKV, plan: StepPlan, scale: float) -> torch.Tensor:
    """Attention for a flat batch of unrotated queries q (T, H, D): decode rows, then prefill chunks.

    A latent pool (MLA) takes absorbed queries (T, H, C + R) and gives (T, H, C)."""
    latent = isinstance(kv, LatentKV)
    decode, prefill = (backend.decode_latent, backend.prefill_latent) if latent else (backend.decode, backend.prefill)
    parts = []
    num_decode = plan.meta.num_decode
    if plan.decode is not None:
        parts.append(decode(q[:num_decode], kv, plan, scale))
    if plan.prefill is not None:
        parts.append(prefill(q[num_decode:], kv, plan, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
