"""The CPU decode kernels (cpu_decode.c, cpu_mla.c): built once per machine with the system's C compiler into
one library, called by ctypes.

Paged decode attention (keys and values per KV head; and MLA's latent rows, cpu_mla.c), the skinny
products (a decode step's few rows times a weight matrix), RMSNorm and the KV write.

Why C and not torch: the reference gathers each sequence's whole context
into a workspace per layer before multiplying (reference.py `decode`), and
that copy, not the arithmetic, was the largest part of a long decode step
(see cpu_decode.c). The kernel reads the pool where it lies. It is an
optimisation only: the reference stays the CPU's oracle, the tests hold the
kernel to it, and without a compiler (or for a quantized pool) the torch
backend runs the reference.

Build and cache: `cpu_build` (a private cache folder; a cached library is
loaded only if no one else can have changed it). The library links libgomp
by soname; torch has already loaded its own copy under that soname, so the
kernel's threads are torch's (one OpenMP runtime, one pool of threads, the
same thread count).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading

import torch

from streamchat.kernels import cpu_build

log = logging.getLogger("streamchat.kernels")

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SCALED = {torch.int8: 3, torch.float8_e4m3fn: 4}  # codes read as codes.float() * scale per token per KV head
RUN_TOKENS = 256  # keys per work item at most (whole blocks): a context of 2,048 in blocks of 16 is 8 items
MAX_HEADS, MAX_HEAD_DIM, MAX_HEADS_X_DIM = 128, 256, 8192  # the kernel's fixed arrays (cpu_decode.c)


def chunk_blocks(block_size: int) -> int:
    """Blocks per work item."""
    return max(1, RUN_TOKENS // block_size)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None (logged once) when it cannot be built."""
    global _lib, _tried
    if _tried:  # every decode-row call asks: no lock once decided
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = os.environ.get("CC", "cc")
        try:
            lib = build_library()
        except cpu_build.UntrustedCache as e:
            log.warning("the CPU decode kernel is not loaded: %s; set STREAMCHAT_KERNEL_CACHE to a folder only "
                        "this user can write. Decode attention runs the torch reference instead", e)
            return None
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("the CPU decode kernel could not be built with %r (%s); decode attention runs the "
                        "torch reference instead", cc, detail.strip().splitlines()[-1:] or e)
            return None
        _lib = lib
        return lib


def build_library(sources: list | None = None) -> ctypes.CDLL:
    """The kernels of `sources` (default cpu_build.SOURCES) built with $CC and loaded, signatures declared;
    raises what cpu_build.build raises. `library()` is the process's; benchmarks load other versions."""
    lib = ctypes.CDLL(str(cpu_build.build(os.environ.get("CC", "cc"), sources)))
    _declare(lib)
    return lib


def bind_threads(n: int) -> list[int]:
    """Bind torch's OpenMP team of `n` threads one to a CPU: thread i (the calling thread is thread 0) to
    the i-th CPU this process may use. Only where that is every CPU it may use, 2 or more, on Linux with
    the library loaded: with CPUs to spare the scheduler has somewhere else to put a thread, and more
    threads than CPUs cannot each have one. Returns the CPUs bound, [] where nothing was. Why bind:
    cpu_threads.c. Call it on the thread that runs the steps once the process's other threads have
    started: a thread it starts later inherits its one CPU."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    lib = library() if 2 <= n == len(cpus) else None
    if lib is None:
        return []
    if lib.bind_threads((ctypes.c_int * n)(*cpus), n) != 0:
        log.warning("the engine core's %d threads could not each be bound to a CPU; the scheduler places them", n)
        os.sched_setaffinity(0, cpus)  # this thread at least (others may have been bound)
        return []
    return cpus


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures (cpu_decode.c, cpu_linear.c, cpu_mla.c, cpu_forward.c) of those the library has (a benchmark's
    older version may lack the newer ones)."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_decode": ([p, p, p, i, p, i64, p, p, p, p, p, i64, p, p, i, i, i, i, i, i, i, f], i),
        "paged_decode_quantized": ([p, p, p, i, p, p, p, i64, p, p, p, p, p, i64, p, p, i, i, i, i, i, i, i, f], i),
        "skinny_linear": ([p, p, p, i, i, i], None),
        "group_linear": ([p, p, i, p, p, p, i, i, i], i),
        "group_linear_x8": ([p, p, i, p, p, p, i, i, i], i),
        "group_dequantize": ([p, i, p, p, p, i, i], None),
        "rms_norm": ([p, p, p, i, i, f], None),
        "bind_threads": ([p, i], i),
        "write_kv": ([p, p, p, p, i, p, p, p, i, i, i, i], None),
        "write_kv_int8": ([p, p, p, p, p, p, p, p, p, i, i, i, i], None),
        "mla_decode": ([p, p, i, p, i64, p, p, p, p, p, i64, p, p, i, i, i, i, i, i, i, f], i),
        "decode_stack": ([p, i, p, p], i),
    }
    for name, (argtypes, restype) in signatures.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype


SKINNY_MAX_ROWS = 32  # up to here `skinny_linear` measured faster than MKL's sgemm (1.0-5.8x; see cpu_decode.c)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T for a float32 x (M, K), M <= SKINNY_MAX_ROWS, and a contiguous float32 weight (N, K)
    on the CPU, by the kernel; None when it does not apply (the caller runs F.linear)."""
    if (x.dim() != 2 or x.shape[0] > SKINNY_MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or not weight.is_contiguous() or x.shape[1] != weight.shape[1]):
        return None
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    lib.skinny_linear(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out


class Groups:
    """Weights in groups of 32 along K as the kernels read them: W = (c - offset) * scale + zero.

    bits 4: `q` (N, K/2) uint8, each group's 16 bytes hold elements 0..15 in their low nibbles and
    16..31 in their high ones (GGML's Q4 payload), offset 8; bits 8: `q` (N, K) int8, offset 0.
    scale, zero: (N, K/32) float32 (zero None: 0).
    """

    def __init__(self, q: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        self.q, self.bits = q.contiguous(), bits
        self.scale = scale.float().contiguous()
        self.zero = None if zero is None else zero.float().contiguous()
        self.n, self.k = scale.shape[0], scale.shape[1] * 32

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> "Groups":
        """4-bit codes (N, K) uint8 0..15 with W = (codes - 8) * scale + zero per group of 32."""
        n, k = codes.shape
        g = codes.view(n, k // 32, 2, 16)
        return cls((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2), 4, scale, zero)

    @classmethod
    def cat(cls, parts: list["Groups"]) -> "Groups":
        """Several matrices' groups stacked along N (a fused projection); all of one width."""
        zero = None if all(p.zero is None for p in parts) else torch.cat(
            [p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts])
        return cls(torch.cat([p.q for p in parts]), parts[0].bits, torch.cat([p.scale for p in parts]), zero)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.scale, self.zero) if t is not None)

    def decodes_to(self, weight: torch.Tensor) -> bool:
        """Whether these groups widen to exactly `weight` (N, K) float32, or to what a bfloat16 `weight`
        is (the float32 weight rounded: the groups then hold it unrounded)."""
        wide = self.dequantize(dense_scratch(self.n * self.k))
        return torch.equal(wide if weight.dtype == torch.float32 else wide.to(weight.dtype), weight)

    def _ptrs(self) -> tuple:
        return (self.q.data_ptr(), self.bits, self.scale.data_ptr(),
                None if self.zero is None else self.zero.data_ptr())

    def matmul(self, x: torch.Tensor, x8: bool = False) -> torch.Tensor | None:
        """x (M, K) float32 @ W.T for M <= SKINNY_MAX_ROWS by the kernel; None past it.

        x8: x rounded to 8 bits per group of 32 and multiplied in integers (`group_linear_x8`: faster,
        not exact; the float kernel where the build has no AVX2)."""
        lib = library()
        if x.shape[0] > SKINNY_MAX_ROWS or lib is None:
            return None
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        args = (x.data_ptr(), *self._ptrs(), out.data_ptr(), x.shape[0], self.n, self.k)
        rc = lib.group_linear_x8(*args) if x8 else -1
        if rc != 0:
            rc = lib.group_linear(*args)
        return out if rc == 0 else None

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """W into `out` (N * K float32 or more), as torch computes (c - offset) * scale + zero."""
        w = out[:self.n * self.k].view(self.n, self.k)
        library().group_dequantize(*self._ptrs(), w.data_ptr(), self.n, self.k)
        return w


_dense_scratch: torch.Tensor | None = None


def dense_scratch(numel: int) -> torch.Tensor:
    """One float32 buffer, grown on demand, that the grouped weights of a long chunk are widened into
    (one matrix at a time, by the engine's thread): freed and reallocated per matrix, blocks this
    large are returned to the OS and faulted in again (see reference.Workspace)."""
    global _dense_scratch
    if _dense_scratch is None or _dense_scratch.numel() < numel:
        _dense_scratch = torch.empty(numel, dtype=torch.float32)
    return _dense_scratch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / rms(x) for a decode step's few float32 rows on the CPU, in one call without a
    parallel region (torch's runs five operators, each waking the OpenMP threads); None otherwise."""
    if (x.dim() != 2 or x.shape[0] > SKINNY_MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or weight.dtype != torch.float32 or library() is None):
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], float(eps))
    return out


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """reference.write_kv into a CPU pool `writes` takes: key, value (T, KVH, D); cos/sin the contiguous
    float32 rope tables; k_scale/v_scale with an int8 pool."""
    t, kv_heads, head_dim = key.shape
    key = key.float().contiguous()
    value = value.float().contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    rows = (slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, kv_heads, head_dim, key_cache.shape[1])
    if k_scale is None:
        library().write_kv(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                           DTYPES[key_cache.dtype], *rows)
    else:
        library().write_kv_int8(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                k_scale.data_ptr(), v_scale.data_ptr(), *rows)


def writes(key_cache: torch.Tensor, k_scale: torch.Tensor | None, head_dim: int) -> bool:
    """Whether `write_kv` writes this pool: unquantized float32/bfloat16/float16 on the CPU, or int8 with
    its scales (fp8 and int4 pools are written by the reference)."""
    if k_scale is None:
        return _cpu_rows(key_cache, head_dim) and key_cache.dtype in DTYPES
    return (key_cache.dtype == torch.int8 and hasattr(library(), "write_kv_int8") and _cpu_rows(key_cache, head_dim)
            and _scaled_rows(key_cache, k_scale))


def supports(key_cache: torch.Tensor, k_scale: torch.Tensor | None, head_dim: int) -> bool:
    """Whether `paged_decode` reads this pool: unquantized as `writes`, or int8 / float8 e4m3fn codes with their
    scales, when the loaded library has that entry (a benchmark's older kernels do not: their callers ran
    the reference)."""
    if k_scale is None:
        return writes(key_cache, k_scale, head_dim)
    return (key_cache.dtype in SCALED and hasattr(library(), "paged_decode_quantized")
            and _cpu_rows(key_cache, head_dim) and _scaled_rows(key_cache, k_scale))


def _cpu_rows(key_cache: torch.Tensor, head_dim: int) -> bool:
    return key_cache.device.type == "cpu" and key_cache.is_contiguous() and key_cache.shape[-1] == head_dim


def _scaled_rows(key_cache: torch.Tensor, k_scale: torch.Tensor) -> bool:
    """One contiguous float32 scale per token per KV head, (num_blocks, block_size, kv_heads) (quant.py)."""
    return k_scale.dtype == torch.float32 and k_scale.is_contiguous() and k_scale.shape == key_cache.shape[:3]


def fits(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this attention shape (else the caller runs the reference)."""
    return (num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM and num_heads * head_dim <= MAX_HEADS_X_DIM
            and head_dim % 8 == 0 and num_heads % num_kv_heads == 0 and block_size <= RUN_TOKENS)


def scratch_sizes(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  max_blocks: int, block_size: int) -> tuple[int, int]:
    """Floats of `partial` and of `stats` (the latter only used with block_mass) for a step's shape."""
    group = num_heads // num_kv_heads
    runs = -(-max_blocks // chunk_blocks(block_size))
    return num_seqs * runs * num_heads * (head_dim + 2), num_seqs * num_kv_heads * group * max_blocks * 2


def check_step(block_tables: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """A decode kernel's step inputs: contiguous int32 tables and lengths, float32 rope tables."""
    for name, t, dtype in (("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
                           ("cos", cos, torch.float32), ("sin", sin, torch.float32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype}, got {t.dtype}")


def mass_scratch(block_mass: torch.Tensor | None, num_seqs: int, max_blocks: int, stats: torch.Tensor | None,
                 n_stats: int) -> tuple[int | None, int, torch.Tensor | None]:
    """(block_mass pointer, its row stride, stats) for a decode kernel; (None, 0, None) without mass.
    `stats` becomes float32 scratch of at least n_stats floats (allocated when None or smaller): the
    caller holds it while the kernel runs."""
    if block_mass is None:
        return None, 0, None
    if (block_mass.dtype != torch.float32 or block_mass.stride(1) != 1 or block_mass.shape[0] < num_seqs
            or block_mass.shape[1] < max_blocks):
        raise ValueError("block_mass must be float32 (>= B, >= max_blocks) with unit inner stride")
    if stats is None or stats.numel() < n_stats:
        stats = torch.empty(n_stats, dtype=torch.float32)
    return block_mass.data_ptr(), block_mass.stride(0), stats


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 scale: float, block_mass: torch.Tensor | None = None,
                 partial: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """reference.paged_decode_attention for a CPU pool `supports` takes: q (B, H, D) -> out (B, H, D) in q's
    dtype; k_scale/v_scale with an int8 or float8 pool.

    block_tables (B, max_blocks) and seq_lens (B,) must be contiguous int32,
    cos/sin contiguous float32; `partial`/`stats` are float32 scratch of at
    least `scratch_sizes` (allocated here when None).
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel is not available (see the log)")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks = block_tables.shape[1]
    check_step(block_tables, seq_lens, cos, sin)
    if (not supports(key_cache, k_scale, head_dim) or not supports(value_cache, v_scale, head_dim)
            or value_cache.dtype != key_cache.dtype):
        raise ValueError(f"the CPU decode kernel reads contiguous float pools and int8/fp8 pools with their "
                         f"scales, not {key_cache.dtype} (scales given: {k_scale is not None})")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    n_partial, n_stats = scratch_sizes(num_seqs, num_heads, num_kv_heads, head_dim, max_blocks, block_size)
    if partial is None or partial.numel() < n_partial:
        partial = torch.empty(n_partial, dtype=torch.float32)
    mass_ptr, mass_stride, stats = mass_scratch(block_mass, num_seqs, max_blocks, stats, n_stats)
    stats_ptr = None if stats is None else stats.data_ptr()
    head = (qf.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr())
    tail = (block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            out.data_ptr(), mass_ptr, mass_stride, partial.data_ptr(), stats_ptr, num_seqs, num_heads,
            num_kv_heads, head_dim, block_size, max_blocks, chunk_blocks(block_size), float(scale))
    if k_scale is None:
        rc = lib.paged_decode(*head, DTYPES[key_cache.dtype], *tail)
    else:
        rc = lib.paged_decode_quantized(*head, SCALED[key_cache.dtype], k_scale.data_ptr(), v_scale.data_ptr(),
                                        *tail)
    if rc != 0:
        raise ValueError(f"the CPU decode kernel does not take this shape (group {num_heads // num_kv_heads}, "
                         f"head_dim {head_dim}, block_size {block_size})")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
