"""Tests for quantized KV storage: round-trip bounds, attention tolerance, pool capacity arithmetic."""

import os

import pytest
import torch

from streamchat.config import CacheConfig, ConfigError
from streamchat.kernels import quant, reference

STORAGES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def keys(n=64, heads=3, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g)
    x[:, :, 5] *= 4  # a per-channel outlier, as unrotated keys have
    return x


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_round_trip_error_is_within_the_format_bound(kv_dtype, bound):
    """|x - dequant(quant(x))| <= bound * max|x| of its row."""
    x = keys()
    q, scale = quant.quantize(x, STORAGES[kv_dtype])
    back = quant.dequantize(q, scale, torch.float32)
    ref = x.abs().amax(-1, keepdim=True)
    assert q.shape == x.shape and scale.shape == (64, 3)
    assert ((back - x).abs() <= bound * ref + 1e-6).all()


def test_int4_round_trip_is_within_half_a_step_of_its_group_range():
    """int4 values: per token per group of 32 a float16 (scale, min) with min <= the group's min and
    min + 15 * scale >= its max (no clipping), scale within float16 rounding of range / 15, and every
    value back within half a step."""
    x = keys()
    q, grid = quant.quantize(x, torch.uint8)
    assert q.shape == (64, 3, 32) and grid.shape == (64, 3, 2, 2) and grid.dtype == torch.float16
    groups = x.view(64, 3, 2, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    step, low = grid[..., 0].float(), grid[..., 1].float()
    assert (low <= lo).all() and (low + 15 * step >= hi).all()
    torch.testing.assert_close(step, (hi - lo) / 15, rtol=2e-3, atol=0)
    back = quant.dequantize(q, grid, torch.float32).view(64, 3, 2, 32)
    assert ((back - groups).abs() <= step[..., None] / 2 + 1e-6).all()


def test_zero_rows_round_trip_exactly():
    """An all-zero row gets scale 1 and comes back as zeros."""
    for storage in STORAGES.values():
        q, scale = quant.quantize(torch.zeros(2, 1, 64), storage)
        assert torch.equal(quant.dequantize(q, scale, torch.float32), torch.zeros(2, 1, 64))


def quantized_attention_error(kv_dtype: str, seed: int) -> float:
    """Max |decode attention over a `kv_dtype` pool - over the float pool| for keys, values and queries
    drawn from `seed` (two sequences of 90 and 96 tokens, gaps in their block tables)."""
    torch.manual_seed(seed)
    nb, bs, kvh, d, h = 12, 16, 3, 64, 9
    k, v = keys(nb * bs, kvh, d, 2 * seed + 1), keys(nb * bs, kvh, d, 2 * seed + 2)
    slots = torch.arange(nb * bs)
    t = torch.arange(512, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / (10000 ** (torch.arange(0, d, 2) / d)))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    fk, fv = torch.zeros(nb, bs, kvh, d), torch.zeros(nb, bs, kvh, d)
    reference.write_kv(fk, fv, k, v, slots, cos, sin)
    storage = STORAGES[kv_dtype]
    width = quant.storage_head_dim(kv_dtype, d)
    qk, qv = torch.zeros(nb, bs, kvh, width, dtype=storage), torch.zeros(nb, bs, kvh, width, dtype=storage)
    kshape, vshape = quant.scale_shapes(kv_dtype, bs, kvh, d)
    sdt = torch.float16 if kv_dtype == "int4" else torch.float32
    ks, vs = torch.ones(nb, *kshape, dtype=sdt), torch.ones(nb, *vshape, dtype=sdt)
    reference.write_kv(qk, qv, k, v, slots, cos, sin, ks, vs)  # quantized after the rotation
    q = torch.randn(2, h, d) * 0.3  # scores of the spread real models show, not one-hot softmax
    tables = torch.tensor([[0, 3, 5, 7, 9, 11], [1, 2, 4, 6, 8, 10]], dtype=torch.int32)
    lens = torch.tensor([90, 96], dtype=torch.int32)
    want = reference.paged_decode_attention(q, fk, fv, tables, lens, cos, sin, d ** -0.5)
    got = reference.paged_decode_attention(q, qk, qv, tables, lens, cos, sin, d ** -0.5, ks, vs)
    return (got - want).abs().max().item()


# Measured: the largest error over seeds 0-19, then a margin of 2x (the figures' spread over those seeds
# is under 1.5x of their mean):
#   .venv/bin/python -c 'import sys; sys.path.insert(0, "tests/kernels"); import test_quant as t;
#     print({k: max(t.quantized_attention_error(k, s) for s in range(20)) for k in t.STORAGES})'
#   -> int8 0.0052, fp8 0.0142, int4 0.0529 (mean 0.0039, 0.0116, 0.0413)
QUANT_ATTENTION_TOL = {"int8": 0.011, "fp8": 0.029, "int4": 0.106}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
def test_attention_over_a_quantized_pool_is_close_to_unquantized(kv_dtype):
    """Decode attention over int8 (fp8, int4) storage stays within the measured tolerance of the float
    pool, for three seeds."""
    errors = [quantized_attention_error(kv_dtype, seed) for seed in range(3)]
    assert max(errors) < QUANT_ATTENTION_TOL[kv_dtype], errors


@pytest.mark.parametrize("kv_dtype,per_head", [("auto", 128), ("int8", 68), ("fp8", 68), ("int4", 44)])
def test_bytes_per_token_and_pool_capacity_are_exact(kv_dtype, per_head):
    """SmolLM2 shape (30 layers, 3 KV heads, dim 64, bf16): bytes per token and blocks in 1 GiB.

    int4: keys 32 bytes + a float16 (scale, min) per channel per block of 16 (16 bytes a token),
    values 32 bytes + two float16 pairs per token (8 bytes): 88 bytes per head for K and V."""
    from streamchat.model.runner import num_blocks_for

    per_token = quant.bytes_per_token(kv_dtype, torch.bfloat16, 30, 3, 64)
    assert per_token == 2 * 30 * 3 * per_head
    blocks = num_blocks_for(CacheConfig(kv_dtype=kv_dtype, kv_memory_gib=1.0), per_token, torch.device("cpu"))
    assert blocks == (1 << 30) // (per_token * 16)
    assert {"auto": 2912, "int8": 5482, "fp8": 5482, "int4": 8473}[kv_dtype] == blocks


def test_the_default_pool_is_an_eighth_of_memory_and_at_least_1_gib():
    """--kv-memory-gib 0 (the default) sizes the pool from the machine's memory."""
    from streamchat.model.runner import auto_kv_bytes, num_blocks_for

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = auto_kv_bytes(torch.device("cpu"))
    assert size == max(1 << 30, total // 8)
    per_token = quant.bytes_per_token("auto", torch.float32, 30, 3, 64)
    assert num_blocks_for(CacheConfig(), per_token, torch.device("cpu")) == size // (per_token * 16)
    with pytest.raises(ConfigError, match="kv_memory_gib must be >= 0"):
        CacheConfig(kv_memory_gib=-1).validate()


def test_bad_kv_dtype_lists_the_choices():
    """--kv-dtype int3 is refused with the list of choices."""
    with pytest.raises(ConfigError, match="kv_dtype must be one of auto, float, int8, fp8, int4; got 'int3'"):
        CacheConfig(kv_dtype="int3").validate()


def int4_pool(nb=4, bs=16, kvh=3, d=64):
    cos, sin = torch.ones(bs, d), torch.zeros(bs, d)  # no rotation: stored keys are the inputs
    kshape, vshape = quant.scale_shapes("int4", bs, kvh, d)
    pool = (torch.zeros(nb, bs, kvh, d // 2, dtype=torch.uint8), torch.zeros(nb, bs, kvh, d // 2, dtype=torch.uint8))
    return pool, (torch.ones(nb, *kshape, dtype=torch.float16), torch.ones(nb, *vshape, dtype=torch.float16)), cos, sin


def stored_keys(pool, scales, block):
    return quant.dequantize_channels(pool[0][block:block + 1], scales[0][block:block + 1], torch.float32)[0]


def test_int4_keys_get_one_scale_per_channel_per_block():
    """A block written at once: per channel a (scale, min) over its tokens, scale ~ (max - min) / 15;
    every key back within half a step."""
    pool, scales, cos, sin = int4_pool()
    x = keys(16)
    reference.write_kv(*pool, x, x, torch.arange(16, 32), cos, sin, *scales)
    lo, hi = x.amin(0), x.amax(0)  # (KVH, D)
    grid = scales[0][1].float()
    assert scales[0][1].shape == (3, 64, 2)
    torch.testing.assert_close(grid[..., 0], (hi - lo) / 15, rtol=2e-3, atol=0)
    assert (grid[..., 1] <= lo).all() and (grid[..., 1] > lo - 1e-3 * lo.abs() - 1e-6).all()
    assert ((stored_keys(pool, scales, 1) - x).abs() <= grid[..., 0] / 2 + 1e-6).all()
    assert torch.equal(scales[0][0], torch.ones(3, 64, 2, dtype=torch.float16))  # other blocks untouched


def test_token_by_token_int4_keys_equal_one_write_when_the_range_never_grows():
    """Decode writes re-quantize the block; once its first tokens hold every channel's min and max, later
    one-token writes leave the same bytes and grid as writing the rest at once."""
    x = keys(16)
    lo, hi = x.amin(0), x.amax(0)
    x[0], x[1] = hi, lo  # the first two tokens span every channel's range
    once, once_scales, cos, sin = int4_pool()
    reference.write_kv(*once, x[:2], x[:2], torch.arange(32, 34), cos, sin, *once_scales)
    reference.write_kv(*once, x[2:], x[2:], torch.arange(34, 48), cos, sin, *once_scales)
    steps, step_scales, _, _ = int4_pool()
    reference.write_kv(*steps, x[:2], x[:2], torch.arange(32, 34), cos, sin, *step_scales)
    for i in range(2, 16):
        reference.write_kv(*steps, x[i:i + 1], x[i:i + 1], torch.tensor([32 + i]), cos, sin, *step_scales)
    assert torch.equal(steps[0], once[0]) and torch.equal(step_scales[0], once_scales[0])
    assert torch.equal(steps[1], once[1]) and torch.equal(step_scales[1], once_scales[1])


def test_int4_key_scale_grows_with_later_tokens_and_ignores_stale_rows():
    """A later, larger token widens its channels' range (no clipping); rows past the last written one
    (a previous owner's tokens) never enter the range."""
    pool, scales, cos, sin = int4_pool()
    big = torch.full((16, 3, 64), 100.0)
    reference.write_kv(*pool, big, big, torch.arange(16, 32), cos, sin, *scales)  # block 1, then reused
    small = torch.full((1, 3, 64), 0.5)
    reference.write_kv(*pool, small, small, torch.tensor([16]), cos, sin, *scales)
    assert torch.equal(scales[0][1][..., 1], torch.full((3, 64), 0.5, dtype=torch.float16))  # its own min
    assert torch.equal(stored_keys(pool, scales, 1)[:1], small)
    larger = torch.full((1, 3, 64), 2.0)
    reference.write_kv(*pool, larger, larger, torch.tensor([17]), cos, sin, *scales)
    got = stored_keys(pool, scales, 1)[:2]
    assert torch.allclose(got, torch.cat([small, larger]), atol=1.5 / 30 + 1e-3)


def test_prefill_and_decode_read_int4_blocks_as_their_dequantized_values():
    """Prefill and decode over an int4 pool (packed to head_dim / 2, per-channel key scales) equal the same
    attention over a float pool holding the dequantized keys and values."""
    nb, bs, kvh, d, h = 4, 16, 3, 64, 9
    k, v = keys(40, kvh, d, 3), keys(40, kvh, d, 4)
    t = torch.arange(64, dtype=torch.float32)
    freqs = torch.outer(t, 1.0 / (10000 ** (torch.arange(0, d, 2) / d)))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    (qk, qv), (ks, vs), _, _ = int4_pool(nb, bs, kvh, d)
    reference.write_kv(qk, qv, k, v, torch.arange(16, 56), cos, sin, ks, vs)
    fk = quant.dequantize_channels(qk, ks, torch.float32)  # as stored: rotated by block offset
    fv = quant.dequantize(qv, vs, torch.float32)
    q = torch.randn(40, h, d, generator=torch.Generator().manual_seed(9))
    tables, lens = torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    args = (tables, lens, torch.tensor([0, 40], dtype=torch.int32), cos, sin, d ** -0.5)
    want = reference.paged_prefill_attention(q, fk, fv, *args)
    got = reference.paged_prefill_attention(q, qk, qv, *args, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want = reference.paged_decode_attention(q[-1:], fk, fv, tables, lens, cos, sin, d ** -0.5)
    got = reference.paged_decode_attention(q[-1:], qk, qv, tables, lens, cos, sin, d ** -0.5, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
