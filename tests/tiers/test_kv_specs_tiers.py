"""Tests of the tiers sized from per-layer KV specs: MLA latents in the KV file and the host tier, exactly."""

import pytest
import torch
from tierkit import VOCAB, layout, same_bytes, snapshot

from streamchat.model.attention import LatentKV
from streamchat.tiers import kvfile
from streamchat.tiers.host import HostTier, copy_blocks
from streamchat.tiers.kvfile import KVFileError

LATENT = (512, 64)  # DeepSeek's kv_lora_rank and qk_rope_head_dim


@pytest.mark.parametrize("kv_dtype,tensors", [
    ("auto", {"latent.0": (torch.bfloat16, (16, 576))}),
    ("int8", {"latent.0": (torch.int8, (16, 576)), "latent_scale.0": (torch.float32, (16, 2))}),
    ("fp8", {"latent.0": (torch.float8_e4m3fn, (16, 576)), "latent_scale.0": (torch.float32, (16, 2))}),
    ("int4", {"latent.0": (torch.uint8, (16, 288)), "latent_scale.0": (torch.float16, (16, 18, 2))})])
def test_mla_file_round_trip_names_its_latents(tmp_path, kv_dtype, tensors):
    """An MLA session's file holds one latent tensor (and its scales) a layer, named by the spec, and
    comes back bit for bit; the header records each layer's spec."""
    lay = layout(mla=LATENT, kv_dtype=kv_dtype, num_layers=3)
    assert {k: v for k, v in kvfile.expected_tensors(lay).items() if k.endswith(".0")} == tensors
    snap = snapshot(lay, num_tokens=40)
    path = tmp_path / "s.safetensors"
    kvfile.write_atomic(path, snap, lay)
    back = kvfile.read(path, lay, snap.session_id, vocab_size=VOCAB)
    assert same_bytes(back.tensors, snap.tensors) and len(back.tensors) == 3 * len(tensors)
    header = kvfile.read_header(path)[0]
    assert header["version"] == 5 and header["layout"]["num_layers"] == 3
    assert header["layout"]["kv_specs"] == [{"kind": "mla", "latent_dim": 512, "rope_dim": 64}] * 3


def test_a_file_of_another_attention_kind_is_foreign(tmp_path):
    """A full-attention file offered to an MLA daemon (same layers, dtypes, block size) is `foreign`,
    naming the first layer whose spec differs."""
    full, mla = layout(), layout(mla=LATENT)
    path = tmp_path / "s.safetensors"
    kvfile.write_atomic(path, snapshot(full), full)
    with pytest.raises(KVFileError) as err:
        kvfile.read(path, mla, "sess_" + "ab" * 16, vocab_size=VOCAB)
    assert err.value.reason == "foreign"
    assert str(err.value) == ("foreign: kv_specs of layer 0 is {'head_dim': 32, 'kind': 'full_attention', "
                              "'num_kv_heads': 3} in the file, {'kind': 'mla', 'latent_dim': 512, 'rope_dim': 64} here")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_host_tier_pools_follow_the_specs_and_copy_exactly(kv_dtype):
    """The host tier allocates latent pools from the specs alone; blocks go down and back bit for bit."""
    lay = layout(mla=(32, 32), kv_dtype=kv_dtype)
    device_pools = [spec.allocate(6, torch.device("cpu")) for spec in lay.kv_specs]
    gen = torch.Generator().manual_seed(0)
    tensors = [t for kv in device_pools for t in kv if t is not None]
    for t in tensors:
        t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
    host = HostTier(lay.kv_specs, 4, torch.device("cpu"))
    assert all(type(kv) is LatentKV and kv.latent.shape == (5, 16, 64) for kv in host.caches)
    assert (host.caches[0].latent_scale is None) == (kv_dtype == "auto")
    before = [t[[1, 4]].clone() for t in tensors]
    copy_blocks(device_pools, [1, 4], host.caches, [2, 3])
    for t in tensors:
        t.zero_()
    copy_blocks(host.caches, [2, 3], device_pools, [5, 2])
    assert all(torch.equal(t[[5, 2]], b) for t, b in zip(tensors, before))
