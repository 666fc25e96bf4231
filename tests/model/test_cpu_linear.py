"""The CPU kernels of a decode step's other operators (kernels/cpu_linear*.c, cpu_decode.c) against torch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quantize

from streamchat.config import ModelConfig
from streamchat.kernels import cpu, reference
from streamchat.model.qlinear import DenseLinear, GroupLinear, Int4Linear, Int8Linear, minmax_codes, q8_0_groups
from streamchat.model.runner import load_model
from streamchat.model.weights import LinearBuilder, served_fingerprint

from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)


@pytest.fixture(autouse=True, scope="module")
def kernels():
    """Built, or every test here fails with the compiler's error (skipped only without a compiler)."""
    return require_kernels()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 products over K summed in another order: within a few ulps of the row's scale."""
    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 32])
@pytest.mark.parametrize("n,k", [(7, 64), (96, 576), (40, 1536)])
def test_skinny_linear_matches_f_linear(rows, n, k):
    """Odd and even row counts, N not a multiple of the four-row runs, K not a multiple of 8 is refused."""
    x, w = randn(rows, k), randn(n, k, seed=1)
    close(cpu.skinny_linear(x, w), F.linear(x, w))


def test_skinny_linear_declines_what_it_does_not_take():
    w = randn(8, 64)
    assert cpu.skinny_linear(randn(cpu.SKINNY_MAX_ROWS + 1, 64), w) is None  # a prefill chunk: sgemm
    assert cpu.skinny_linear(randn(2, 64).double(), w.double()) is None
    assert cpu.skinny_linear(randn(2, 64), w.t().contiguous().t()) is None  # not contiguous


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 80])
def test_int4_groups_match_their_dense_weight(rows):
    """Decode rows multiply the 4-bit codes; longer chunks widen them into exactly the dense weight."""
    codes = minmax_codes(randn(48, 256))
    dense = codes.dequantize()
    lin = Int4Linear(codes)
    assert lin.groups is not None and torch.equal(lin.groups.dequantize(torch.empty(dense.numel())), dense)
    x = randn(rows, 256, seed=2)
    y, ref = lin(x), F.linear(x, dense)
    if rows > cpu.SKINNY_MAX_ROWS:
        assert torch.equal(y, ref)  # the same sgemm on the same weight
    else:
        close(y, ref)


def test_q8_0_groups_decode_like_gguf():
    """A real Q8_0 tensor (gguf's quantizer): w = d * q per block of 32, exactly."""
    w = randn(24, 128).numpy()
    raw = torch.from_numpy(quantize(w, GGMLQuantizationType.Q8_0))
    groups = q8_0_groups(raw.view(24, -1))
    blocks = raw.view(24, 4, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (24, 4, 1)
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # (24, 4, 32)
    dense = (d * q).view(24, 128)
    assert torch.equal(groups.dequantize(torch.empty(dense.numel())), dense)
    x = randn(3, 128, seed=3)
    close(GroupLinear(groups)(x), F.linear(x, dense))
    assert np.abs(dense.numpy() - w).max() < 0.05  # it is the tensor quantized


def test_int8_per_channel_through_the_kernel():
    w = randn(40, 192)
    lin = Int8Linear.quantize(w)
    scale = w.abs().amax(dim=1) / 127.0  # in float32 here (torch's kernel takes it in bf16)
    assert torch.equal(lin.groups.scale, scale[:, None].expand(-1, 192 // 32))
    dense = lin.q.float() * scale[:, None]
    x = randn(4, 192, seed=4)
    close(lin(x), F.linear(x, dense))


def test_dense_linear_uses_groups_only_for_decode_rows():
    codes = minmax_codes(randn(32, 64))
    dense = codes.dequantize()
    lin = DenseLinear(dense, groups=cpu.Groups.from_codes(*codes))
    for rows in (1, 32, 33):
        x = randn(rows, 64, seed=rows)
        close(lin(x), F.linear(x, dense))
    assert torch.equal(lin(randn(33, 64)), F.linear(randn(33, 64), dense))


def random_groups(n: int, k: int, bits: int, zero: bool, seed: int = 0) -> tuple[cpu.Groups, torch.Tensor]:
    """Random codes of either width with scales (and zeros), and the dense weight they decode to."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    zeros = torch.randn(n, k // 32, generator=gen) * 0.01 if zero else None
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        groups = cpu.Groups.from_codes(codes, scale, zeros if zero else torch.zeros_like(scale))
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        groups = cpu.Groups(codes, 8, scale, zeros)
    return groups, groups.dequantize(torch.empty(n * k))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bits,zero", [(4, True), (8, False), (8, True)], ids=str)
@pytest.mark.parametrize("n,k", [(7, 96), (45, 576), (13, 1536)])
def test_one_or_two_rows_multiply_the_codes_directly(rows, bits, zero, n, k):
    """A session's decode rows (the direct path): rows not a multiple of the four a pass takes, an odd
    number of groups, 8-bit codes with and without zeros; the float path only reorders the sums."""
    groups, dense = random_groups(n, k, bits, zero)
    x = randn(rows, k, seed=3)
    close(groups.matmul(x), F.linear(x, dense))


@pytest.mark.parametrize("bits,zero", [(4, True), (8, False)], ids=str)
@pytest.mark.parametrize("n,k", [(45, 576), (13, 1536)])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(bits, zero, n, k):
    """A decode row multiplied alone, beside one other or in a batch of up to MAX_ROWS gives the same bits:
    a batch of sessions then equals each session alone (tests/engine's greedy batched = alone), and a
    quantized KV block written from either holds the same codes."""
    groups, _ = random_groups(n, k, bits, zero)
    x = randn(cpu.SKINNY_MAX_ROWS, k, seed=6)
    alone = torch.cat([groups.matmul(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 3, 16, cpu.SKINNY_MAX_ROWS):
        assert torch.equal(groups.matmul(x[:rows]), alone[:rows]), rows


def x8_oracle(x: torch.Tensor, groups: cpu.Groups, dense: torch.Tensor) -> torch.Tensor:
    """What group_linear_x8 computes, in float64: x rounded to 8 bits per group of 32 (x * 127 / max|x| to
    nearest even, in float32 as the kernel rounds it) times the codes, the offset with x's codes too, the
    zero with x itself."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)  # (M, G, 1)
    inv = torch.where(amax > 0, 127 / amax, 0.0)
    xq = torch.round(xg * inv) * (amax / 127)  # (M, G, 32): x as its codes carry it
    zero = groups.zero if groups.zero is not None else torch.zeros_like(groups.scale)
    w_off = (dense.view(groups.n, k // 32, 32) - zero[..., None]).double()  # (N, G, 32): (c - offset) * scale
    code = torch.einsum("mgj,ngj->mn", xq.double(), w_off)
    return (code + xg.sum(-1).double() @ zero.double().T).float()


@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(9, 96), (40, 576)])
def test_8_bit_activations_are_integer_products_of_rounded_x(rows, bits, n, k):
    """group_linear_x8 equals its definition (x rounded to 8 bits per group, exact integer products) to
    float32 rounding, and is about 1% from the float product; every row count takes that path."""
    groups, dense = random_groups(n, k, bits, zero=bits == 4, seed=rows)
    x = randn(rows, k, seed=4)
    y = groups.matmul(x, x8=True)
    close(y, x8_oracle(x, groups, dense))
    ref = F.linear(x, dense)
    assert (y - ref).abs().max() < 0.03 * ref.abs().max()


def test_8_bit_activations_give_a_row_the_same_bits_alone_and_in_a_batch():
    """Each row of x is quantized and multiplied on its own: alone or among others, the same bits."""
    groups, _ = random_groups(48, 576, 4, zero=True)
    x = randn(7, 576, seed=5)
    batch = groups.matmul(x, x8=True)
    for i in range(7):
        assert torch.equal(groups.matmul(x[i:i + 1], x8=True)[0], batch[i])


def test_decode_activations_int8_reaches_every_grouped_layer():
    """LinearBuilder(activations="int8") makes the dense layers' GGUF groups multiply 8-bit x (and the
    served fingerprint says so); prefill chunks still multiply the dense weight exactly."""
    codes = minmax_codes(randn(32, 64))
    dense = codes.dequantize()
    lin = DenseLinear(dense, groups=cpu.Groups.from_codes(*codes), x8=True)
    x = randn(2, 64, seed=6)
    assert torch.equal(lin(x), lin.groups.matmul(x, x8=True)) and not torch.equal(lin(x), lin.groups.matmul(x))
    assert torch.equal(lin(randn(33, 64)), F.linear(randn(33, 64), dense))
    parts = ("q_proj", "o_proj", "gate_proj", "down_proj", "head")
    assert all(LinearBuilder("bf16", activations="int8").x8(p) for p in parts)
    assert not any(LinearBuilder("bf16").x8(p) for p in parts)
    mixed = LinearBuilder("bf16", activations="mixed")  # o, down and the head only
    assert [mixed.x8(p) for p in parts] == [False, True, False, True, True]
    assert served_fingerprint("abc", "bf16", "mixed") == "abc+xmixed"
    with pytest.raises(ValueError, match="unknown decode activations"):
        LinearBuilder("bf16", activations="int4")
    assert served_fingerprint("abc", "bf16", "int8") == "abc+xint8"
    assert served_fingerprint("abc", "int4", "float32") == "abc+int4"


def test_rms_norm_matches_torch():
    x, w = randn(5, 576), randn(576, seed=1)
    ref = w * F.rms_norm(x, (576,), eps=1e-5)
    close(cpu.rms_norm(x, w, 1e-5), ref)
    assert cpu.rms_norm(randn(cpu.SKINNY_MAX_ROWS + 1, 8), randn(8), 1e-5) is None


def rope_tables(positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (positions, d) contiguous float32, rotate-half layout."""
    pos = torch.arange(positions, dtype=torch.float32)[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos * inv, pos * inv], dim=1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_kv_matches_reference(dtype):
    """Keys rotated by their offset in the block and values, into scattered slots, as the reference."""
    blocks, bs, kvh, d = 6, 16, 3, 64
    ours = [torch.zeros(blocks, bs, kvh, d, dtype=dtype) for _ in range(2)]
    ref = [torch.zeros(blocks, bs, kvh, d, dtype=dtype) for _ in range(2)]
    key, value = randn(7, kvh, d), randn(7, kvh, d, seed=1)
    slots = torch.tensor([17, 18, 40, 41, 5, 95, 64])
    cos, sin = rope_tables(64, d)
    cpu.write_kv(*ours, key, value, slots, cos, sin)
    reference.write_kv(*ref, key, value, slots, cos, sin)
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours[0].float(), ref[0].float(), atol=tol + 1e-6, rtol=tol)
    assert torch.equal(ours[1], ref[1])  # values: stored as given


def test_bundled_model_keeps_the_gguf_blocks_beside_its_dense_weights():
    """On CPU in float32 the default (dense) format also holds the file's own Q4_1 layers and Q8_0 head,
    each checked at load to decode to exactly its dense weight."""
    model = load_model(ModelConfig(dtype="float32")).model
    assert {layer.qkv.groups.bits for layer in model.layers} == {4}
    assert all(layer.down.groups is not None and layer.gate_up.groups is not None for layer in model.layers)
    assert model.lm_head.groups.bits == 8


def test_write_kv_into_an_int8_pool_matches_reference_bit_for_bit():
    """Rotated keys and values quantized per row (codes and scales) exactly as the reference quantizes them,
    a row of zeros (scale 1) and rows that round at .5 included."""
    blocks, bs, kvh, d = 6, 16, 3, 64
    pools = [[torch.zeros(blocks, bs, kvh, d, dtype=torch.int8) for _ in range(2)]
             + [torch.zeros(blocks, bs, kvh) for _ in range(2)] for _ in range(2)]
    key, value = randn(7, kvh, d), randn(7, kvh, d, seed=1)
    value[2, 1] = 0.0
    value[3, 0] = torch.arange(d) - 31.5  # codes at half steps
    slots = torch.tensor([17, 18, 40, 41, 5, 95, 64])
    cos, sin = rope_tables(bs, d)
    assert cpu.writes(pools[0][0], pools[0][2], d)
    ours, ref = pools
    cpu.write_kv(ours[0], ours[1], key, value, slots, cos, sin, ours[2], ours[3])
    reference.write_kv(ref[0], ref[1], key, value, slots, cos, sin, ref[2], ref[3])
    for got, want in zip(ours, ref):
        assert torch.equal(got, want)
    assert ours[3].view(-1, kvh)[40, 1] == 1.0  # the zero row (token 2, slot 40)
    assert not cpu.writes(torch.zeros(blocks, bs, kvh, d, dtype=torch.float8_e4m3fn), ours[2], d)  # fp8: reference
