"""Paged decode and prefill kernels against the pure-torch reference (CPU: TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from streamchat.kernels import reference  # noqa: E402
from streamchat.kernels.decode import paged_decode, plan_splits, split_tokens  # noqa: E402
from streamchat.kernels.prefill import paged_prefill  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def needs_gpu(test):
    """Full sizes: a CUDA GPU with compiled (not interpreted) kernels: TRITON_INTERPRET=0 pytest -m gpu."""
    skip = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                              reason="full sizes run compiled: " + (
                                  "no CUDA device" if not torch.cuda.is_available() else "TRITON_INTERPRET=1 was set"))
    return pytest.mark.gpu(skip(test))


QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


# ---- building pools ---------------------------------------------------------------------------


def rope(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin tables (max_pos, head_dim) float32."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, D)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) symmetric quantization of x (..., D) -> (stored, scale (...))."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    y = x.float() / scale[..., None]
    if dtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))
    return y.clamp(-QMAX[dtype], QMAX[dtype]).to(dtype), scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The pool as the kernels read it: x.to(float32) * scale, poison (nan) read as 0."""
    x = cache.float() if scale is None else cache.float() * scale[..., None]
    return torch.nan_to_num(x, nan=0.0)


class Pool:
    """One layer's pool holding `lens` tokens per sequence in shuffled physical blocks.

    Every slot no sequence holds (whole blocks, block 0 which pads the tables,
    the tail of each last block) is nan, or has a nan scale: a kernel that
    reads one poisons its output.
    """

    def __init__(self, lens, num_kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=5):
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype = block_size, dtype
        counts = [-(-n // block_size) for n in lens]
        num_blocks = 1 + sum(counts) + spare_blocks
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        keys = torch.full(shape, float("nan"))
        values = torch.full(shape, float("nan"))
        for b, (n, count) in enumerate(zip(lens, counts)):
            row, ids = ids[:count], ids[count:]
            self.tables[b, :count] = torch.tensor(row, dtype=torch.int32)
            for i, block_id in enumerate(row):
                used = min(block_size, n - i * block_size)
                keys[block_id, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen)
                values[block_id, :used] = torch.randn(used, num_kv_heads, head_dim, generator=gen)
        if dtype in QMAX:
            (self.key, self.k_scale), (self.value, self.v_scale) = quantize(keys, dtype), quantize(values, dtype)
        else:
            self.key, self.value, self.k_scale, self.v_scale = keys.to(dtype), values.to(dtype), None, None
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.to(DEVICE)

    def to(self, device):
        for name in ("key", "value", "k_scale", "v_scale", "tables", "seq_lens"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))

    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def clean(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool for the reference: dequantized, poison zeroed, in `dtype`."""
        return dequantize(self.key, self.k_scale).to(dtype), dequantize(self.value, self.v_scale).to(dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 2e-2 if out.dtype in (torch.bfloat16, torch.float16) else 2e-5
    assert not out.isnan().any(), "the kernel read a slot it does not own"
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def decode_case(pool: Pool, num_heads: int, head_dim: int, q_dtype, **kwargs):
    """(kernel out, reference out) for one decode step over the pool's sequences."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(pool.seq_lens), num_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    cos, sin = rope(int(pool.tables.shape[1]) * pool.block_size, head_dim)
    scale = head_dim ** -0.5
    out = paged_decode(q, pool.key, pool.value, pool.tables, pool.seq_lens, cos, sin, scale,
                       **pool.scales(), **kwargs)
    key, value = pool.clean(q_dtype)
    ref = reference.paged_decode_attention(q, key, value, pool.tables, pool.seq_lens, cos, sin, scale)
    return out, ref


def prefill_case(pool: Pool, chunks, num_heads: int, head_dim: int, q_dtype, **kwargs):
    """(kernel out, reference out) for chunks[b] queries at the end of each sequence."""
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), num_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    cos, sin = rope(int(pool.tables.shape[1]) * pool.block_size, head_dim)
    scale = head_dim ** -0.5
    out = paged_prefill(q, pool.key, pool.value, pool.tables, pool.seq_lens, cu, cos, sin, scale,
                        **pool.scales(), **kwargs)
    key, value = pool.clean(q_dtype)
    ref = reference.paged_prefill_attention(q, key, value, pool.tables, pool.seq_lens, cu, cos, sin, scale)
    return out, ref


DTYPES = [torch.float32, torch.bfloat16]
# Every head_dim x GQA ratio x block size in float32; bfloat16 on block size 16 (the interpreter is slow).
CASES = ([(d, g, bs, torch.float32) for d in (64, 128) for g in (1, 3, 4) for bs in (16, 32)]
         + [(d, g, 16, torch.bfloat16) for d in (64, 128) for g in (1, 3, 4)])


# ---- decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,group,block_size,dtype", CASES, ids=str)
def test_decode_matches_reference(head_dim, group, block_size, dtype):
    """Ragged lengths in shuffled blocks give the reference's output for every head_dim, GQA ratio and block size."""
    pool = Pool([1, 37, 70], num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_matches(*decode_case(pool, 2 * group, head_dim, dtype))


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_splits_reduce_to_the_same_output(num_splits):
    """Splitting the sequence (with empty splits for the short sequences) and reducing changes nothing."""
    pool = Pool([3, 40, 150], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    assert_matches(*decode_case(pool, 4, 64, torch.float32, num_splits=num_splits, block_n=16))


def test_decode_tile_spans_blocks():
    """A key tile of 64 tokens gathers four 16-token blocks of the table at once."""
    pool = Pool([50, 130], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    assert_matches(*decode_case(pool, 6, 64, torch.float32, block_n=64, num_splits=2))


def evicted_pool(block_size: int, dtype) -> Pool:
    """A sequence of 9 blocks whose blocks 1-4 were evicted: table = [sink, 5, 6, 7, 8], then 3 tokens more."""
    pool = Pool([9 * block_size], num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype, seed=3)
    held = pool.tables[0, [0, 5, 6, 7, 8]]
    for block_id in pool.tables[0, 1:5].tolist():  # evicted blocks keep stale data nobody may read
        pool.key[block_id] = float("nan") if dtype not in QMAX else 0
        if pool.k_scale is not None:
            pool.k_scale[block_id] = float("nan")
            pool.v_scale[block_id] = float("nan")
        else:
            pool.value[block_id] = float("nan")
    pool.tables = held[None, :].contiguous()
    pool.seq_lens = torch.tensor([4 * block_size + 3], dtype=torch.int32, device=DEVICE)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_decode_through_evicted_gaps(dtype):
    """Sinks then later blocks: positions are table indices, evicted blocks are never read."""
    pool = evicted_pool(16, dtype)
    assert pool.tables.tolist()[0] != sorted(pool.tables.tolist()[0])
    assert_matches(*decode_case(pool, 4, 64, torch.float32, num_splits=2, block_n=16))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("q_dtype", DTYPES, ids=str)
def test_decode_dequantizes_scaled_pool(kv_dtype, q_dtype):
    """int8/fp8 storage with a scale per token per KV head matches the reference on the dequantized pool."""
    pool = Pool([20, 45], num_kv_heads=2, head_dim=64, block_size=16, dtype=kv_dtype)
    assert_matches(*decode_case(pool, 8, 64, q_dtype, num_splits=2))


def test_plan_splits_fills_the_machine_without_tiny_splits():
    """Few long sequences split up to two programs per SM; many or short ones do not split."""
    assert plan_splits(num_programs=8, max_tokens=65536, num_sms=132) == 33
    assert plan_splits(num_programs=256 * 8, max_tokens=65536, num_sms=132) == 1
    assert plan_splits(num_programs=8, max_tokens=512, num_sms=132) == 2
    assert plan_splits(num_programs=1, max_tokens=100_000_000, num_sms=132) == 64
    assert plan_splits(num_programs=1, max_tokens=16, num_sms=4) == 1


def test_split_tokens_rounds_to_whole_tiles():
    """Splits hold whole key tiles, and rounding up never leaves a trailing empty split."""
    assert split_tokens(65536, 33, 64) == (32, 2048)
    assert split_tokens(160, 5, 16) == (5, 32)
    assert split_tokens(160, 3, 64) == (3, 64)
    assert split_tokens(100, 4, 64) == (2, 64)


# ---- prefill ----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,group,block_size,dtype", CASES, ids=str)
def test_prefill_matches_reference(head_dim, group, block_size, dtype):
    """Varlen chunks (whole prompt, append after cached blocks, one token) match for every shape."""
    pool = Pool([21, 40, 7], num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_matches(*prefill_case(pool, [21, 18, 1], 2 * group, head_dim, dtype, rows=32))


def test_prefill_tiles_of_one_chunk():
    """A chunk longer than a query tile runs as several tiles of the same sequence, causal across them."""
    pool = Pool([70, 5], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    assert_matches(*prefill_case(pool, [50, 5], 2, 64, torch.float32, rows=16, block_n=32))


def test_prefill_empty_chunk_and_spare_programs():
    """A sequence with no queries this step and the grid's spare programs write nothing."""
    pool = Pool([9, 30], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    assert_matches(*prefill_case(pool, [0, 17], 4, 64, torch.float32, rows=16))


def test_prefill_through_evicted_gaps():
    """A chunk appended after an eviction sees the sink and the later blocks by table position."""
    pool = evicted_pool(16, torch.float32)
    assert_matches(*prefill_case(pool, [20], 4, 64, torch.float32, rows=32))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_prefill_dequantizes_scaled_pool(kv_dtype):
    """Prefill over an int8/fp8 pool matches the reference on the dequantized pool."""
    pool = Pool([25, 40], num_kv_heads=2, head_dim=64, block_size=16, dtype=kv_dtype)
    assert_matches(*prefill_case(pool, [25, 9], 6, 64, torch.float32, rows=32))


# ---- int64 addressing -------------------------------------------------------------------------

HUGE_STRIDE = 1 << 20  # elements (int8: bytes) per block
HUGE_BLOCKS = 4102


@pytest.fixture(scope="module")
def huge_pool():
    """An int8 pool of 4102 blocks with a 1 MiB block stride, K and V in one 4 GiB allocation.

    The allocation is virtual: only the pages of the blocks written below
    are ever touched. The table's blocks 4101 and 4098 start at element
    offsets 2**32 + 5 * 2**20 and 2**32 + 2 * 2**20. The interpreter's int32
    arithmetic wraps like the GPU's, so an int32 `block_id * stride` would
    read blocks 5 and 2 instead, which hold decoys: the output would differ.
    """
    num_kv_heads, head_dim, block_size = 2, 64, 16
    try:
        storage = torch.empty(HUGE_BLOCKS * HUGE_STRIDE, dtype=torch.int8, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # strict overcommit (vm.overcommit_memory=2)
        pytest.skip(f"cannot reserve 4 GiB of address space: {exc}")
    shape = (HUGE_BLOCKS, block_size, num_kv_heads, head_dim)
    stride = (HUGE_STRIDE, num_kv_heads * head_dim, head_dim, 1)
    key = storage.as_strided(shape, stride, 0)
    value = storage.as_strided(shape, stride, HUGE_STRIDE // 2)
    k_scale = torch.full(shape[:3], float("nan"), device=DEVICE)
    v_scale = torch.full(shape[:3], float("nan"), device=DEVICE)
    ids = [4101, 3, 4098]
    gen = torch.Generator().manual_seed(4)
    for block_id in ids + [5, 2]:
        for cache, scale in ((key, k_scale), (value, v_scale)):
            data, block_scale = quantize(torch.randn(block_size, num_kv_heads, head_dim, generator=gen), torch.int8)
            cache[block_id] = data.to(DEVICE)
            if block_id in ids:
                scale[block_id] = block_scale.to(DEVICE)
    yield key, value, k_scale, v_scale, ids
    del storage


def compact(huge_pool):
    """The huge pool's three blocks as a small float pool and its table [0, 1, 2]."""
    key, value, k_scale, v_scale, ids = huge_pool
    small_key = dequantize(key[ids], k_scale[ids])
    small_value = dequantize(value[ids], v_scale[ids])
    return small_key, small_value, torch.arange(3, dtype=torch.int32, device=DEVICE)[None, :]


def test_decode_addresses_blocks_past_int32(huge_pool):
    """Blocks at element offsets >= 2**32 are read where they are (int64 block offsets)."""
    key, value, k_scale, v_scale, ids = huge_pool
    table = torch.tensor([ids], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([2 * 16 + 5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    cos, sin = rope(48, 64)
    out = paged_decode(q, key, value, table, seq_lens, cos, sin, 0.125, k_scale, v_scale, num_splits=2,
                       block_n=16)
    small_key, small_value, small_table = compact(huge_pool)
    ref = reference.paged_decode_attention(q, small_key, small_value, small_table, seq_lens, cos, sin, 0.125)
    assert_matches(out, ref)


def test_prefill_addresses_blocks_past_int32(huge_pool):
    """Prefill reads blocks at element offsets >= 2**32 where they are."""
    key, value, k_scale, v_scale, ids = huge_pool
    table = torch.tensor([ids], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(20, 4, 64, device=DEVICE)
    cos, sin = rope(48, 64)
    out = paged_prefill(q, key, value, table, seq_lens, cu, cos, sin, 0.125, k_scale, v_scale, rows=32)
    small_key, small_value, small_table = compact(huge_pool)
    ref = reference.paged_prefill_attention(q, small_key, small_value, small_table, seq_lens, cu, cos, sin,
                                            0.125)
    assert_matches(out, ref)


# ---- full sizes (GPU) -------------------------------------------------------------------------


def full_pool(lens, num_kv_heads, head_dim, block_size, dtype):
    """A pool of real size on the GPU, without poison (for speed), tables shuffled."""
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 1
    ids = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    start = 0
    for b, count in enumerate(counts):
        tables[b, :count] = ids[start:start + count]
        start += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(shape, device="cuda").to(dtype)
    value = torch.randn(shape, device="cuda").to(dtype)
    return key, value, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


@needs_gpu
@pytest.mark.parametrize("lens", [[32768], [1000 + 97 * i for i in range(64)]], ids=["one-long", "batch-64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_full_size(lens, dtype):
    """Llama-8B-shaped decode (32 heads, 8 KV heads, head_dim 128) at real lengths matches the reference."""
    key, value, tables, seq_lens = full_pool(lens, 8, 128, 16, dtype)
    q = torch.randn(len(lens), 32, 128, device="cuda").to(dtype)
    cos, sin = rope(max(lens) + 16, 128)
    out = paged_decode(q, key, value, tables, seq_lens, cos, sin, 128 ** -0.5)
    ref = reference.paged_decode_attention(q, key, value, tables, seq_lens, cos, sin, 128 ** -0.5)
    assert_matches(out, ref)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_full_size(dtype):
    """A step of real chunks (a 2k prompt, a 1k append after 6k cached, one token) matches the reference."""
    lens, chunks = [2048, 7000, 300], [2048, 1000, 1]
    key, value, tables, seq_lens = full_pool(lens, 8, 128, 16, dtype)
    cu = torch.tensor([0, 2048, 3048, 3049], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(chunks), 32, 128, device="cuda").to(dtype)
    cos, sin = rope(max(lens) + 16, 128)
    out = paged_prefill(q, key, value, tables, seq_lens, cu, cos, sin, 128 ** -0.5)
    ref = reference.paged_prefill_attention(q, key, value, tables, seq_lens, cu, cos, sin, 128 ** -0.5)
    assert_matches(out, ref)
