"""The KV write kernel against `reference.write_kv` (CPU: TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from streamchat.kernels import reference  # noqa: E402
from streamchat.kernels.write_kv import write_kv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def fused_kv(num_tokens, num_kv_heads, head_dim, dtype, seed=0):
    """key, value (T, KVH, D) as the runner has them: strided views of one qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    q_size = 3 * num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    _, k, v = qkv.split([q_size, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


def scattered_slots(num_tokens, num_blocks, block_size, seed=0):
    """Distinct slots spread over shuffled blocks, the pool's last block included."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[0] = num_blocks * block_size - 1
    return slots.to(DEVICE)


def rope(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin tables (max_pos, head_dim) float32."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv).repeat(1, 2)  # (max_pos, D)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def rotated(key: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """key (T, KVH, D) rotated by each slot's offset in its block, float32: what the pool stores."""
    cos, sin = rope(block_size, key.shape[-1])
    offsets = slots % block_size
    c, s = cos[offsets][:, None], sin[offsets][:, None]
    k = key.float()
    k1, k2 = k.chunk(2, dim=-1)
    return k * c + torch.cat((-k2, k1), dim=-1) * s


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) symmetric quantization of x (..., D) -> (stored, scale (...))."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    y = x.float() / scale[..., None]
    if dtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5))
    return y.clamp(-QMAX[dtype], QMAX[dtype]).to(dtype), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 64, 32), (2, 128, 16)])
def test_write_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    """Strided keys (rotated by block offset) and values land in their slots as the reference puts them
    (values bit-exact, keys to float32 rounding); every other slot is untouched."""
    num_blocks = 9
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape).to(dtype).to(DEVICE)
    ref_key, ref_value = key_cache.clone(), value_cache.clone()
    key, value = fused_kv(21, num_kv_heads, head_dim, dtype)
    slots = scattered_slots(21, num_blocks, block_size)
    cos, sin = rope(64, head_dim)
    write_kv(key_cache, value_cache, key, value, slots, cos, sin)
    reference.write_kv(ref_key, ref_value, key, value, slots, cos, sin)
    assert torch.equal(value_cache, ref_value)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    flat = key_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[~written], ref_key.view(-1, num_kv_heads, head_dim)[~written])
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of a float32 product, either side
    torch.testing.assert_close(flat[slots], ref_key.view(-1, num_kv_heads, head_dim)[slots], atol=tol, rtol=tol)
    torch.testing.assert_close(flat[slots].float(), rotated(key, slots, block_size), atol=tol, rtol=tol)


def test_write_takes_int32_slots():
    """An int32 slot mapping writes the same slots as an int64 one."""
    key_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    key, value = fused_kv(5, 2, 64, torch.float32)
    slots = scattered_slots(5, 4, 16)
    write_kv(key_cache, value_cache, key, value, slots.to(torch.int32), *rope(16, 64))
    torch.testing.assert_close(key_cache.view(-1, 2, 64)[slots], rotated(key, slots, 16), atol=1e-6, rtol=1e-6)
    assert torch.equal(value_cache.view(-1, 2, 64)[slots], value)


@pytest.mark.parametrize("kv_dtype", [
    torch.int8,
    pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(
        INTERPRET, reason="the interpreter's float32 -> fp8 conversion mis-rounds (125.97 becomes 64)")),
], ids=str)
def test_write_quantizes_per_token_per_head(kv_dtype):
    """An int8/fp8 pool stores round(x / scale), scale = max|x| / Q_MAX per token per KV head, of the
    rotated key: quantized after the rotation."""
    key_cache = torch.zeros(6, 16, 2, 64, dtype=kv_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.full((6, 16, 2), float("nan"), device=DEVICE)
    v_scale = torch.full_like(k_scale, float("nan"))
    key, value = fused_kv(13, 2, 64, torch.bfloat16)
    key[3] = 0.0  # an all-zero row keeps scale 1
    slots = scattered_slots(13, 6, 16)
    write_kv(key_cache, value_cache, key, value, slots, *rope(16, 64), k_scale, v_scale)
    for cache, scale, x in ((key_cache, k_scale, rotated(key, slots, 16)), (value_cache, v_scale, value)):
        want, want_scale = quantize(x, kv_dtype)
        got = cache.view(-1, 2, 64)[slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scale.view(-1, 2)[slots], want_scale)
    assert torch.equal(k_scale.view(-1, 2)[slots[3]], torch.ones(2, device=DEVICE))
    written = torch.zeros(6 * 16, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert k_scale.view(-1, 2)[~written].isnan().all()  # no other slot's scale is touched


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
def test_write_addresses_blocks_past_int32(slot_dtype):
    """Slots in blocks at element offsets >= 2**32 are written where they are, whatever the slot dtype.

    A 4 GiB int8 pool with a 1 MiB block stride, all virtual but the pages
    touched: an int32 `block_id * stride` for block 4101 would wrap to block 5.
    """
    stride, num_blocks = 1 << 20, 4102
    try:
        storage = torch.empty(num_blocks * stride, dtype=torch.int8, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"cannot reserve 4 GiB of address space: {exc}")
    shape, strides = (num_blocks, 16, 2, 64), (stride, 128, 64, 1)
    key_cache = storage.as_strided(shape, strides, 0)
    value_cache = storage.as_strided(shape, strides, stride // 2)
    for block_id in (4101, 4098, 3, 5, 2):  # the only pages ever touched
        key_cache[block_id] = 0
        value_cache[block_id] = 0
    k_scale = torch.zeros(shape[:3], device=DEVICE)
    v_scale = torch.zeros_like(k_scale)
    key, value = fused_kv(3, 2, 64, torch.float32)
    slots = torch.tensor([4101 * 16 + 7, 4098 * 16, 3 * 16 + 15], dtype=slot_dtype, device=DEVICE)
    write_kv(key_cache, value_cache, key, value, slots, *rope(16, 64), k_scale, v_scale)
    want_key, _ = quantize(rotated(key, slots, 16), torch.int8)
    want_value, _ = quantize(value, torch.int8)
    assert torch.equal(key_cache[4101, 7], want_key[0]) and torch.equal(value_cache[4098, 0], want_value[1])
    assert torch.equal(key_cache[3, 15], want_key[2])
    assert not key_cache[5].any() and not key_cache[2].any()  # where int32 offsets would have landed
    del key_cache, value_cache, storage
