"""The C decode kernel (kernels/cpu_decode.c) against the pure-torch reference, and the backend that runs it."""

import pytest
import torch

from streamchat.kernels import cpu, reference
from streamchat.model.attention import CpuBackend, DecodeGroup, Heads, LayerKV, StepPlan, TorchBackend, make_backend

from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)
from test_kernel_attention import Pool, evicted_pool, rope  # tests/kernels is on sys.path

SCALED = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """Built, or every test here fails with the compiler's error (skipped only without a compiler)."""
    return require_kernels()


def case(pool: Pool, num_heads: int, head_dim: int, mass: bool = False, seed: int = 1):
    """(kernel out, reference out, kernel mass, reference mass) for one decode step over the pool."""
    gen = torch.Generator().manual_seed(seed)
    q_dtype = torch.float32 if pool.k_scale is not None else pool.key.dtype
    q = torch.randn(len(pool.seq_lens), num_heads, head_dim, generator=gen).to(q_dtype)
    cos, sin = rope(int(pool.tables.shape[1]) * pool.block_size, head_dim)
    scale = head_dim ** -0.5
    width = pool.tables.shape[1] + 2  # the runner's accumulator is wider than the table
    got_mass = torch.full((len(pool.seq_lens), width), 0.5) if mass else None
    ref_mass = got_mass.clone() if mass else None
    out = cpu.paged_decode(q, pool.key, pool.value, pool.tables, pool.seq_lens, cos, sin, scale, got_mass,
                           k_scale=pool.k_scale, v_scale=pool.v_scale)
    key, value = pool.clean(torch.float32)
    ref = reference.paged_decode_attention(q.float(), key, value, pool.tables, pool.seq_lens, cos, sin, scale,
                                           block_mass=ref_mass)
    return out, ref, got_mass, ref_mass


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "the kernel read a slot it does not own"
    tol = 2e-5 if out.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, *SCALED], ids=str)
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (64, 3, 16), (128, 4, 32), (64, 8, 8)],
                         ids=str)
def test_matches_reference_for_ragged_lengths(head_dim, group, block_size, dtype):
    """Ragged lengths in shuffled blocks (every slot no sequence holds is nan, or has a nan scale), each GQA
    ratio and block size, across more than one run of blocks per sequence (the runs are merged); int8 and
    fp8 pools against the reference on the dequantized pool."""
    lens = [1, 37, 70, cpu.RUN_TOKENS * 2 + 5]
    pool = Pool(lens, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype)
    out, ref, _, _ = case(pool, 2 * group, head_dim)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reads_16_bit_pools(dtype):
    """bfloat16 and float16 pools are widened row by row; the output comes back in the query's dtype."""
    pool = Pool([5, 300], num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    out, ref, _, _ = case(pool, 9, 64)
    assert out.dtype == dtype
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_attention_mass_matches_reference(dtype):
    """With block_mass the kernel ADDS each block's probability summed over heads, as the reference does."""
    pool = Pool([3, 16, 200, 700], num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    out, ref, got_mass, ref_mass = case(pool, 9, 64, mass=True)
    assert_close(out, ref)
    torch.testing.assert_close(got_mass, ref_mass, atol=1e-5, rtol=1e-5)
    blocks = (pool.seq_lens + 15) // 16
    assert torch.allclose(got_mass.sum(1) - 0.5 * got_mass.shape[1], torch.full((4,), 9.0), atol=1e-4)
    assert (got_mass[0, blocks[0]:] == 0.5).all()  # past a sequence's blocks nothing is added


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_reads_through_evicted_gaps(dtype):
    """Sinks then later blocks (positions are table indices); evicted blocks, poisoned, are never read."""
    pool = evicted_pool(16, dtype)
    out, ref, _, _ = case(pool, 4, 64)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(dtype):
    """The runs of blocks depend only on a sequence's own length: batched = alone, bit for bit
    (what greedy batched = alone needs)."""
    lens = [900, 17, 333]
    pool = Pool(lens, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(5))
    cos, sin = rope(int(pool.tables.shape[1]) * 16, 64)
    scales = dict(k_scale=pool.k_scale, v_scale=pool.v_scale)
    batch = cpu.paged_decode(q, pool.key, pool.value, pool.tables, pool.seq_lens, cos, sin, 0.125, **scales)
    for b in range(3):
        alone = cpu.paged_decode(q[b:b + 1], pool.key, pool.value, pool.tables[b:b + 1].contiguous(),
                                 pool.seq_lens[b:b + 1].contiguous(), cos, sin, 0.125, **scales)
        assert torch.equal(alone[0], batch[b])


@pytest.mark.parametrize("dtype", SCALED, ids=str)
def test_widens_every_code_exactly(dtype):
    """A one-token sequence's output is its value row times 1 (a single key's softmax), so it shows the
    dequantized row itself: every one of the 256 codes reads as code.float() * scale, bit for bit (fp8's
    subnormals and nan included)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).view(4, 1, 1, 64)  # a token per block
    scale = torch.tensor([0.5, 3.0, 1e-3, 7.25]).view(4, 1, 1)
    keys = torch.zeros_like(codes)
    tables = torch.arange(4, dtype=torch.int32).view(4, 1)
    out = cpu.paged_decode(torch.randn(4, 1, 64), keys, codes, tables, torch.ones(4, dtype=torch.int32),
                           *rope(16, 64), 0.125, k_scale=torch.ones(4, 1, 1), v_scale=scale)
    expect = codes.float() * scale[..., None]  # quant.dequantize
    torch.testing.assert_close(out.view(4, 64), expect.view(4, 64), atol=0, rtol=0, equal_nan=True)
    if dtype == torch.float8_e4m3fn:
        assert out.isnan().sum() == 2  # 0x7f and 0xff


def test_refuses_what_it_cannot_read():
    """int4 pools and scales of another shape go to the reference (supports() says no); wrong index dtypes
    are a clear error."""
    int4 = torch.zeros(3, 16, 1, 32, dtype=torch.uint8)
    assert not cpu.supports(int4, torch.zeros(3, 16, 1, 2, 2, dtype=torch.float16), 64)
    int8 = Pool([20], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.int8)
    assert cpu.supports(int8.key, int8.k_scale, 64) and cpu.writes(int8.key, int8.k_scale, 64)
    fp8 = Pool([20], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float8_e4m3fn)
    assert cpu.supports(fp8.key, fp8.k_scale, 64) and not cpu.writes(fp8.key, fp8.k_scale, 64)  # reference's
    assert not cpu.supports(int8.key, int8.k_scale.double(), 64)
    assert not cpu.supports(int8.key, int8.k_scale[:, :8], 64)
    f32 = Pool([20], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    cos, sin = rope(32, 64)
    with pytest.raises(ValueError, match="block_tables must be contiguous torch.int32"):
        cpu.paged_decode(torch.randn(1, 2, 64), f32.key, f32.value, f32.tables.long(), f32.seq_lens, cos, sin, 1.0)
    with pytest.raises(ValueError, match="does not take this shape"):  # head_dim not a multiple of 8
        odd = torch.randn(4, 16, 1, 12)
        cpu.paged_decode(torch.randn(1, 1, 12), odd, odd, torch.zeros(1, 1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), *rope(16, 12), 1.0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_backend_reads_quantized_pools_with_the_kernel(dtype, monkeypatch):
    """CpuBackend.decode sends an int8/fp8 layer to the kernel (the reference is never asked) and gives what
    the torch backend gives."""
    pool = Pool([3, 40, 300], num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    kv = LayerKV(pool.key, pool.value, pool.k_scale, pool.v_scale)
    group = DecodeGroup(pool.tables, pool.seq_lens)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    cos, sin = rope(int(pool.tables.shape[1]) * 16, 64)
    ref_backend = TorchBackend()
    ref_plan = StepPlan(None, None, ref_backend.decode_plan(group, 16, cos, sin, torch.float32,
                                                          Heads(9, 3, 64)), None)
    expect = ref_backend.decode(q, LayerKV(*pool.clean(torch.float32)), ref_plan, 0.125)
    backend = CpuBackend()
    plan = StepPlan(None, None, backend.decode_plan(group, 16, cos, sin, torch.float32, Heads(9, 3, 64)), None)
    monkeypatch.setattr(reference, "decode", lambda *a, **k: pytest.fail("the reference ran"))
    assert_close(backend.decode(q, kv, plan, 0.125), expect)


def test_auto_backend_on_cpu_is_the_kernel_and_torch_stays_the_reference():
    assert isinstance(make_backend("auto", torch.device("cpu")), CpuBackend)
    torch_backend = make_backend("torch", torch.device("cpu"))
    assert isinstance(torch_backend, TorchBackend) and not isinstance(torch_backend, CpuBackend)
    with pytest.raises(ValueError, match="needs a CPU device"):
        make_backend("cpu", torch.device("meta"))


def test_attention_mass_with_fewer_rows_than_sequences_is_refused():
    """The kernel adds into block_mass[b] for every sequence b: a shorter accumulator is an error, not a write
    past its end (found by AddressSanitizer)."""
    bs, num_blocks, heads, kv_heads, d = 16, 8, 4, 2, 32
    kc, vc = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    lens = torch.tensor([20, 30, 17], dtype=torch.int32)
    cos, sin = torch.ones(64, d), torch.zeros(64, d)
    with pytest.raises(ValueError, match="block_mass"):
        cpu.paged_decode(torch.randn(3, heads, d), kc, vc, tables, lens, cos, sin, 0.1, block_mass=torch.zeros(2, 2))


def prefill_step(backend, pool: Pool, query_lens: list[int], heads: Heads):
    """A prefill-only StepPlan over the pool: the last query_lens[b] tokens of sequence b are its chunk."""
    from streamchat.model.attention import AttentionMetadata, PrefillGroup

    key_lens = pool.seq_lens.tolist()
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(k - n, k) for n, k in zip(query_lens, key_lens)])
    meta = AttentionMetadata(torch.zeros(len(positions), dtype=torch.long), pool.block_size, None,
                             PrefillGroup(cu, pool.tables, pool.seq_lens, list(query_lens), key_lens))
    cos, sin = rope(int(pool.tables.shape[1]) * pool.block_size, heads.head_dim)
    return StepPlan(meta, *backend.plan(meta, positions, cos, sin, torch.float32, heads)), cos, sin, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_short_prefill_chunks_go_to_the_kernel_row_by_row(dtype, monkeypatch):
    """Chunks of up to SHORT_PREFILL_TOKENS (a question against a long history, a whole short prompt) are
    attended by the decode kernel, each query row up to its own position, and give the reference's
    output; a longer chunk in the step sends the whole step to the reference."""
    from streamchat.model import attention

    heads = Heads(9, 3, 64)
    pool = Pool([40, 300, 20], num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    kv = LayerKV(pool.key, pool.value, pool.k_scale, pool.v_scale)
    q = torch.randn(5 + 30 + 20, 9, 64, generator=torch.Generator().manual_seed(4))
    plan, cos, sin, cu = prefill_step(CpuBackend(), pool, [5, 30, 20], heads)
    key, value = pool.clean(torch.float32)
    expect = reference.paged_prefill_attention(q, key, value, pool.tables, pool.seq_lens, cu, cos, sin, 0.125)
    with monkeypatch.context() as m:
        m.setattr(reference, "prefill", lambda *a, **k: pytest.fail("the reference ran"))
        assert_close(CpuBackend().prefill(q, kv, plan, 0.125), expect)
    long = attention.SHORT_PREFILL_TOKENS + 1
    pool = Pool([40, 300], num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    plan, *_ = prefill_step(CpuBackend(), pool, [5, long], heads)
    assert plan.write[3] is None  # the reference's step
