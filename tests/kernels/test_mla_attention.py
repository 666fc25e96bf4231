"""MLA attention over the paged latent: the torch reference against dense attention written out here,
the Triton decode kernel (TRITON_INTERPRET=1 on CPU) and the C kernel against the reference, and the
latent write."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from streamchat.kernels import cpu, cpu_mla, mla_reference, quant  # noqa: E402
from streamchat.kernels.mla_decode import paged_mla_decode  # noqa: E402

from kernel_build import require_kernels  # noqa: E402 - tests/ is on sys.path (its conftest.py)

STORAGE = {"auto": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
SMALL = (4, 32, 16)  # heads, C, R: a tiny latent
V2_LITE = (16, 512, 64)  # DeepSeek-V2-Lite's heads, kv_lora_rank, qk_rope_head_dim


def rope(max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv).repeat(1, 2)  # (max_pos, R), halves repeat
    return emb.cos(), emb.sin()


def rotate64(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotation of x (..., R) by positions (broadcast), in float64."""
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    ang = pos.double()[..., None] * inv
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LatentPool:
    """Sequences of `lens` tokens in shuffled physical blocks of a latent pool, stored as the write
    stores them; every slot no sequence holds is nan (or has a nan scale), so a read of one poisons."""

    def __init__(self, lens, latent_dim, rope_dim, block_size, kv_dtype="auto", seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.block_size, self.latent_dim = lens, block_size, latent_dim
        counts = [-(-n // block_size) for n in lens]
        num_blocks = 1 + sum(counts) + 3
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
        self.latents = []  # per sequence: (n, C + R) unrotated, float32
        width = latent_dim + rope_dim
        floats = torch.full((num_blocks, block_size, width), float("nan"))
        slots = []
        for b, (n, count) in enumerate(zip(lens, counts)):
            row, ids = ids[:count], ids[count:]
            self.tables[b, :count] = torch.tensor(row, dtype=torch.int32)
            self.latents.append(torch.randn(n, width, generator=gen))
            slots.append(torch.tensor([row[t // block_size] * block_size + t % block_size for t in range(n)]))
        self.cos, self.sin = rope(4 * block_size + max(lens), rope_dim)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.scale = None
        if kv_dtype == "auto":
            self.cache = floats
        else:
            self.cache = torch.zeros(floats.shape, dtype=STORAGE[kv_dtype])
            self.scale = torch.full((num_blocks, block_size, 2), float("nan"))
        for x, slot in zip(self.latents, slots):
            mla_reference.write_latent(self.cache, x, slot, self.cos, self.sin, self.scale)

    def clean(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cache, scale) with the poison read as 0: what the reference, which reads whole blocks and
        masks the scores (0 x nan is nan), is given; real pools hold stale but finite rows there."""
        scale = None if self.scale is None else torch.nan_to_num(self.scale, nan=0.0)
        return (torch.nan_to_num(self.cache, nan=0.0) if self.scale is None else self.cache), scale

    def stored(self, b: int) -> torch.Tensor:
        """Sequence b's rows as the kernels read them, dequantized, float64 (n, C + R), table order."""
        rows = mla_reference.block_rows(self.tables[b, :-(-self.lens[b] // self.block_size)], self.block_size)
        return mla_reference.gather_rows(*self.clean(), rows, self.latent_dim, torch.float32)[:self.lens[b]].double()


def dense(pool: LatentPool, q: torch.Tensor, b: int, first_pos: int, scale: float):
    """Dense attention of sequence b's queries q (n, H, C + R) at positions first_pos.., causal, over its
    stored rows with each rotary key put back at its cache position: (out (n, H, C), probs (n, H, L))."""
    rows = pool.stored(b)
    length, c_dim = rows.shape[0], pool.latent_dim
    pos = torch.arange(length)
    keys = torch.cat((rows[:, :c_dim], rotate64(rows[:, c_dim:], pos // pool.block_size * pool.block_size)), -1)
    q_pos = first_pos + torch.arange(q.shape[0])
    qs = torch.cat((q[..., :c_dim].double(), rotate64(q[..., c_dim:], q_pos[:, None])), -1)  # (n, H, C + R)
    s = torch.einsum("nhw,lw->nhl", qs, keys) * scale
    s = s.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
    probs = s.softmax(-1)
    return torch.einsum("nhl,lc->nhc", probs, rows[:, :c_dim]), probs


def queries(num_seqs: int, heads: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_seqs, heads, width, generator=torch.Generator().manual_seed(seed))


def block_sums(probs: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """probs (..., L) summed over every leading dim and per block of keys: (width,)."""
    flat = probs.reshape(-1, probs.shape[-1]).sum(0)
    flat = torch.nn.functional.pad(flat, (0, width * block_size - flat.shape[0]))
    return flat.view(width, block_size).sum(1)


@pytest.mark.parametrize("block_size,kv_dtype", [(16, "auto"), (64, "auto"), (16, "int8"), (8, "fp8")])
def test_reference_decode_is_dense_attention(block_size, kv_dtype):
    """Absorbed decode over shuffled blocks (lengths 1, a block edge, several blocks): the dense
    attention of the stored rows, and each block's attention mass summed over the heads."""
    heads, c_dim, r_dim = SMALL
    pool = LatentPool([1, block_size, 3 * block_size + 5], c_dim, r_dim, block_size, kv_dtype)
    q = queries(3, heads, c_dim + r_dim)
    mass = torch.zeros(3, pool.tables.shape[1] + 1)
    cache, scale = pool.clean()
    out = mla_reference.paged_mla_decode(q, cache, pool.tables, pool.seq_lens, pool.cos, pool.sin, 0.3, scale, mass)
    for b, n in enumerate(pool.lens):
        want, probs = dense(pool, q[b:b + 1], b, n - 1, 0.3)
        torch.testing.assert_close(out[b].double(), want[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mass[b].double(), block_sums(probs, block_size, mass.shape[1]), atol=2e-5, rtol=0)


def test_reference_prefill_is_causal_dense_attention():
    """Chunks with and without cached tokens before them, in one call: dense causal attention, and
    the chunks' attention mass per block."""
    heads, c_dim, r_dim = SMALL
    pool = LatentPool([40, 9, 33], c_dim, r_dim, 16)
    query_lens = [7, 9, 1]
    q = queries(sum(query_lens), heads, c_dim + r_dim)
    cu = torch.tensor([0, 7, 16, 17], dtype=torch.int32)
    mass = torch.zeros(3, 4)
    cache, _ = pool.clean()
    out = mla_reference.paged_mla_prefill(q, cache, pool.tables, pool.seq_lens, cu, pool.cos, pool.sin, 0.25, None,
                                          mass)
    for b, (n, length) in enumerate(zip(query_lens, pool.lens)):
        want, probs = dense(pool, q[cu[b]:cu[b + 1]], b, length - n, 0.25)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(mass[b].double(), block_sums(probs, 16, 4), atol=2e-5, rtol=0)
    plain = mla_reference.paged_mla_prefill(q, cache, pool.tables, pool.seq_lens, cu, pool.cos, pool.sin, 0.25)
    torch.testing.assert_close(plain, out, atol=1e-5, rtol=1e-5)  # SDPA without the mass: the same


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_write_rotates_the_rope_part_by_block_offset(kv_dtype):
    """The stored row is [c | R(offset) k_r], quantized per part (c's scale, k_r's scale) when asked."""
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([17, 3, 40, 41, 0])
    cos, sin = rope(16, 16)
    cache = torch.zeros(4, 16, 48, dtype=STORAGE[kv_dtype])
    scale = None if kv_dtype == "auto" else torch.ones(4, 16, 2)
    mla_reference.write_latent(cache, x, slots, cos, sin, scale)
    want = torch.cat((x[:, :32].double(), rotate64(x[:, 32:], slots % 16)), -1).float()
    got = cache.view(-1, 48)[slots]
    if kv_dtype == "auto":
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    else:
        stored, scales = quant.quantize_latent(want, cache.dtype, 32)
        assert torch.equal(got.view(torch.uint8), stored.view(torch.uint8))
        torch.testing.assert_close(scale.view(-1, 2)[slots], scales, atol=0, rtol=1e-6)


@pytest.mark.parametrize("shape,block_size,kv_dtype,num_splits", [
    (SMALL, 16, "auto", None), (SMALL, 64, "auto", 2), (SMALL, 8, "auto", 3), (SMALL, 16, "int8", 2),
    (SMALL, 32, "fp8", None), (V2_LITE, 64, "auto", 2)])
def test_triton_decode_equals_the_reference(shape, block_size, kv_dtype, num_splits):
    """The Triton MLA decode kernel (interpreted) equals the reference: blocks of 8 (two a tile), 16, 32
    and FlashMLA's 64, forced splits, int8 and fp8 latents, and V2-Lite's 16 heads x (512 + 64)."""
    heads, c_dim, r_dim = shape
    lens = [1, block_size + 3, 2 * block_size + 1] if c_dim < 512 else [5, 70]
    pool = LatentPool(lens, c_dim, r_dim, block_size, kv_dtype, seed=2)
    q = queries(len(lens), heads, c_dim + r_dim, seed=3)
    want = mla_reference.paged_mla_decode(q, *pool.clean()[:1], pool.tables, pool.seq_lens, pool.cos, pool.sin,
                                          0.2, pool.clean()[1])
    got = paged_mla_decode(q, pool.cache, pool.tables, pool.seq_lens, pool.cos, pool.sin, 0.2, pool.scale,
                           num_splits=num_splits)
    assert got.shape == (len(lens), heads, c_dim) and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,block_size,shape", [(torch.float32, 16, V2_LITE), (torch.float32, 64, V2_LITE),
                                                    (torch.float32, 8, (6, 64, 32)), (torch.bfloat16, 16, V2_LITE)])
def test_cpu_kernel_equals_the_reference(dtype, block_size, shape):
    """The C MLA decode (cpu_mla.c) equals the reference, attention mass per block included, over
    sequences of one token up to several runs of 256 (V2-Lite's 16 heads x (512 + 64); 6 heads, which
    its groups of four do not divide). The kernel must build: a failed build fails here rather than
    skipping; only a machine without a C compiler skips, saying so."""
    require_kernels()
    heads, c_dim, r_dim = shape
    pool = LatentPool([1, block_size + 3, 300, 600], c_dim, r_dim, block_size, seed=4)
    cache = pool.clean()[0].to(dtype)
    q = queries(4, heads, c_dim + r_dim, seed=5).to(dtype)
    assert cpu_mla.supports(cache, None, heads, r_dim)
    masses = [torch.zeros(4, pool.tables.shape[1] + 2) for _ in range(2)]
    want = mla_reference.paged_mla_decode(q, cache, pool.tables, pool.seq_lens, pool.cos, pool.sin, 0.05, None,
                                          masses[0])
    got = cpu_mla.paged_mla_decode(q, cache, pool.tables, pool.seq_lens, pool.cos, pool.sin, 0.05, masses[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the reference rounds its products to bf16
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(masses[1], masses[0], atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="full sizes run compiled: " + ("no CUDA device" if not torch.cuda.is_available()
                                                          else "TRITON_INTERPRET=1 was set"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_decode_full_size(dtype):
    """V2-Lite's decode (16 heads x (512 + 64), FlashMLA's blocks of 64) over 16 sessions of 900 to 4,000
    tokens, compiled: the reference's result (bf16 within its rounding)."""
    lens = [900 + 200 * i for i in range(16)]
    nb = [-(-n // 64) for n in lens]
    ids = torch.randperm(sum(nb) + 8)[:sum(nb)] + 1
    tables = torch.zeros(16, max(nb), dtype=torch.int32)
    for b, start in enumerate([sum(nb[:b]) for b in range(16)]):
        tables[b, :nb[b]] = ids[start:start + nb[b]]
    cache = torch.randn(sum(nb) + 9, 64, 576, device="cuda").to(dtype)
    q = torch.randn(16, 16, 576, device="cuda").to(dtype)
    cos, sin = (t.cuda() for t in rope(max(lens) + 64, 64))
    tables, seq_lens = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    got = paged_mla_decode(q, cache, tables, seq_lens, cos, sin, 192 ** -0.5)
    want = mla_reference.paged_mla_decode(q.float(), cache.float(), tables, seq_lens, cos, sin, 192 ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
