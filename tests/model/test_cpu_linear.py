"""The CPU kernels of a decode step's other operators (kernels/cpu_decode.c) against torch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quantize

from streamchat.config import ModelConfig
from streamchat.kernels import cpu, reference
from streamchat.model.qlinear import DenseLinear, GroupLinear, Int4Linear, Int8Linear, minmax_codes, q8_0_groups
from streamchat.model.runner import load_model

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernels are not built")


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


def test_rms_norm_matches_torch():
    x, w = randn(5, 576), randn(576, seed=1)
    ref = w * F.rms_norm(x, (576,), eps=1e-5)
    close(cpu.rms_norm(x, w, 1e-5), ref)
    assert cpu.rms_norm(randn(cpu.SKINNY_MAX_ROWS + 1, 8), randn(8), 1e-5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_kv_matches_reference(dtype):
    """Keys rotated by their offset in the block and values, into scattered slots, as the reference."""
    blocks, bs, kvh, d = 6, 16, 3, 64
    ours = [torch.zeros(blocks, bs, kvh, d, dtype=dtype) for _ in range(2)]
    ref = [torch.zeros(blocks, bs, kvh, d, dtype=dtype) for _ in range(2)]
    key, value = randn(7, kvh, d), randn(7, kvh, d, seed=1)
    slots = torch.tensor([17, 18, 40, 41, 5, 95, 64])
    pos = torch.arange(64, dtype=torch.float32)[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos * inv, pos * inv], dim=1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
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
