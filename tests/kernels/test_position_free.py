"""Position-free blocks: pools written through write_kv, then evicted, attend like a dense rotate-everything oracle.

Keys are written (rotated by their offset in their block) while their
blocks sit at their first table positions; then blocks after the sinks are
evicted, shifting every later block's cache positions, and nothing in the
pool is touched. Decode and prefill, reference and Triton (CPU:
TRITON_INTERPRET=1), must equal an oracle that rotates every unrotated key
by its cache position AFTER the eviction and the query by its own.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from streamchat.kernels import reference  # noqa: E402
from streamchat.kernels.decode import paged_decode  # noqa: E402
from streamchat.kernels.prefill import paged_prefill  # noqa: E402
from streamchat.kernels.write_kv import write_kv  # noqa: E402

BLOCK = 16
KV_HEADS, HEAD_DIM = 2, 64


def rope(max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def dense_rope(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D) rotated by pos (N,) the textbook way: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[pos][:, None] + torch.cat((-x2, x1), dim=-1) * sin[pos][:, None]


class Conversation:
    """Sequences whose blocks were written in shuffled physical blocks, then partly evicted.

    Sequence b had lens[b] tokens in blocks at table indices 0 .. n-1 when
    written; evict[b] table indices (after the sink block 0) then left its
    table. Its cache is what remains, in order: positions 0 .. seq_len-1.
    """

    def __init__(self, lens, evict, kv_dtype, write, seed=0):
        gen = torch.Generator().manual_seed(seed)
        counts = [-(-n // BLOCK) for n in lens]
        num_blocks = 1 + sum(counts)
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        quantized = kv_dtype == torch.int8
        self.key = torch.zeros(shape, dtype=kv_dtype)
        self.value = torch.zeros(shape, dtype=kv_dtype)
        self.k_scale = torch.ones(shape[:3]) if quantized else None
        self.v_scale = torch.ones(shape[:3]) if quantized else None
        self.cos, self.sin = rope(max(lens) + BLOCK)
        self.keys, self.values, tables = [], [], []  # raw K/V of the cache, in cache order
        for n, count, gone in zip(lens, counts, evict):
            row, ids = ids[:count], ids[count:]
            k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
            v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
            kept = [0] + list(range(1 + len(gone), count))  # the sink block, then the blocks after the gap
            assert gone == list(range(1, 1 + len(gone)))
            # cache order after the eviction; written where they were placed before it (the
            # evicted blocks' writes are skipped: the interpreter runs a program per token)
            tokens = torch.cat([torch.arange(i * BLOCK, min(n, (i + 1) * BLOCK)) for i in kept])
            slots = torch.tensor([row[t // BLOCK] * BLOCK + t % BLOCK for t in tokens.tolist()])
            write(self.key, self.value, k[tokens], v[tokens], slots, self.cos, self.sin, self.k_scale, self.v_scale)
            tables.append([row[i] for i in kept])
            self.keys.append(k[tokens])
            self.values.append(v[tokens])
            for i in gone:  # evicted blocks hold stale data nobody may read
                self.key[row[i]] = 0 if quantized else float("nan")
                self.value[row[i]] = 0 if quantized else float("nan")
                if quantized:
                    self.k_scale[row[i]] = self.v_scale[row[i]] = float("nan")
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.seq_lens = torch.tensor([len(k) for k in self.keys], dtype=torch.int32)

    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def oracle(self, b: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """Queries q (n, H, D) at cache positions q_pos (n,) of sequence b, every key rotated by its position."""
        probs = self.oracle_probs(b, q, q_pos, scale)
        v = self.values[b].repeat_interleave(q.shape[1] // KV_HEADS, dim=1)
        return torch.einsum("nhl,lhd->nhd", probs, v)

    def oracle_mass(self, b: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float, width: int) -> torch.Tensor:
        """Attention probabilities summed over heads and queries per block of cache positions: (width,)."""
        per_key = self.oracle_probs(b, q, q_pos, scale).sum((0, 1))  # (L,)
        mass = torch.zeros(width * BLOCK)
        mass[:per_key.shape[0]] = per_key
        return mass.view(width, BLOCK).sum(1)

    def oracle_probs(self, b: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        n_keys = len(self.keys[b])
        pos = torch.arange(n_keys)
        k = dense_rope(self.keys[b], pos, self.cos, self.sin)
        group = q.shape[1] // KV_HEADS
        k = k.repeat_interleave(group, dim=1)  # (L, H, D)
        scores = torch.einsum("nhd,lhd->nhl", dense_rope(q, q_pos, self.cos, self.sin), k) * scale
        scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        return scores.softmax(-1)  # (n, H, L)


LENS = [7 * BLOCK + 5, 2 * BLOCK, 4 * BLOCK + 11]  # after eviction: 3 blocks + 5, 2 blocks, 3 blocks + 11
EVICT = [[1, 2, 3, 4], [], [1]]
TOL = {torch.float32: 2e-5, torch.int8: 0.03}  # int8: the quantization step (test_quant's tolerance)
CASES = [(reference.write_kv, reference.paged_decode_attention, reference.paged_prefill_attention),
         (write_kv, paged_decode, paged_prefill)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
@pytest.mark.parametrize("impl", CASES, ids=["reference", "triton"])
def test_decode_after_eviction_equals_dense_oracle(impl, kv_dtype):
    """Decode over shuffled tables with evicted gaps equals rotating every key by its new cache position."""
    write, decode, _ = impl
    conv = Conversation(LENS, EVICT, kv_dtype, write)
    q = torch.randn(len(LENS), 3 * KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    scale = HEAD_DIM ** -0.5
    out = decode(q, conv.key, conv.value, conv.tables, conv.seq_lens, conv.cos, conv.sin, scale, **conv.scales())
    assert not out.isnan().any(), "read a slot an evicted block or the padding holds"
    for b in range(len(LENS)):
        last = conv.seq_lens[b:b + 1].long() - 1
        want = conv.oracle(b, q[b:b + 1], last, scale)[0]
        torch.testing.assert_close(out[b], want, atol=TOL[kv_dtype], rtol=TOL[kv_dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
@pytest.mark.parametrize("impl", CASES, ids=["reference", "triton"])
def test_prefill_after_eviction_equals_dense_oracle(impl, kv_dtype):
    """Chunks at the end of evicted sequences (a whole block's worth, one token, a ragged tail) match the oracle."""
    write, _, prefill = impl
    conv = Conversation(LENS, EVICT, kv_dtype, write, seed=1)
    chunks = [17, 1, 30]
    cu = torch.tensor([0, 17, 18, 48], dtype=torch.int32)
    assert all(n <= int(length) for n, length in zip(chunks, conv.seq_lens))
    q = torch.randn(sum(chunks), 3 * KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    scale = HEAD_DIM ** -0.5
    out = prefill(q, conv.key, conv.value, conv.tables, conv.seq_lens, cu, conv.cos, conv.sin, scale,
                  **conv.scales())
    assert not out.isnan().any()
    for b, n in enumerate(chunks):
        q_pos = torch.arange(int(conv.seq_lens[b]) - n, int(conv.seq_lens[b]))
        want = conv.oracle(b, q[cu[b]:cu[b + 1]], q_pos, scale)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], want, atol=TOL[kv_dtype], rtol=TOL[kv_dtype])


def test_block_bytes_do_not_depend_on_table_position():
    """The same 16 keys written into a block at table index 0 or 7 store the same bytes (rotated by offset)."""
    cos, sin = rope(8 * BLOCK)
    k = torch.randn(BLOCK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    pools = []
    for write in (reference.write_kv, write_kv):
        for table_idx, block_id in ((0, 3), (7, 5)):
            key = torch.zeros(8, BLOCK, KV_HEADS, HEAD_DIM)
            value = torch.zeros_like(key)
            slots = block_id * BLOCK + torch.arange(BLOCK)  # cache positions table_idx * 16 + o: unused
            write(key, value, k, k, slots, cos, sin)
            pools.append(key[block_id])
    assert torch.equal(pools[0], pools[1]) and torch.equal(pools[2], pools[3])
    torch.testing.assert_close(pools[0], dense_rope(k, torch.arange(BLOCK), cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[2], pools[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
def test_reference_block_mass_equals_dense_oracle(kv_dtype):
    """The attention mass per block that decode and prefill add (h2o's scores) equals the dense oracle's
    probabilities summed over heads and queries per block, and adds up to heads x queries."""
    conv = Conversation(LENS, EVICT, kv_dtype, reference.write_kv, seed=2)
    gen = torch.Generator().manual_seed(8)
    scale, heads, width = HEAD_DIM ** -0.5, 3 * KV_HEADS, conv.tables.shape[1]
    tol = 1e-4 if kv_dtype == torch.float32 else 0.02  # int8: the quantized keys move the probabilities
    q = torch.randn(len(LENS), heads, HEAD_DIM, generator=gen)
    mass = torch.full((len(LENS), width + 1), 1.0)  # added to, not overwritten
    reference.paged_decode_attention(q, conv.key, conv.value, conv.tables, conv.seq_lens, conv.cos, conv.sin,
                                     scale, **conv.scales(), block_mass=mass)
    for b in range(len(LENS)):
        want = conv.oracle_mass(b, q[b:b + 1], conv.seq_lens[b:b + 1].long() - 1, scale, width)
        torch.testing.assert_close(mass[b, :width] - 1, want, atol=tol, rtol=tol)
        assert mass[b, width] == 1 and abs(float(mass[b].sum()) - (width + 1) - heads) < 1e-4
    chunks = [17, 1, 30]
    cu = torch.tensor([0, 17, 18, 48], dtype=torch.int32)
    q = torch.randn(sum(chunks), heads, HEAD_DIM, generator=gen)
    mass = torch.zeros(len(LENS), width)
    out = reference.paged_prefill_attention(q, conv.key, conv.value, conv.tables, conv.seq_lens, cu, conv.cos,
                                            conv.sin, scale, **conv.scales(), block_mass=mass)
    plain = reference.paged_prefill_attention(q, conv.key, conv.value, conv.tables, conv.seq_lens, cu, conv.cos,
                                              conv.sin, scale, **conv.scales())
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)  # explicit attention = SDPA's
    for b, n in enumerate(chunks):
        q_pos = torch.arange(int(conv.seq_lens[b]) - n, int(conv.seq_lens[b]))
        want = conv.oracle_mass(b, q[cu[b]:cu[b + 1]], q_pos, scale, width)
        torch.testing.assert_close(mass[b], want, atol=tol * n, rtol=tol)
