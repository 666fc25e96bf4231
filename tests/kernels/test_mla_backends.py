"""An MLA model's steps on the cpu and Triton backends (TRITON_INTERPRET=1 on CPU) give what the torch
reference backend gives: logits and latent pools, float and int8 latents, with an eviction mid-way."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from streamchat.cache.block_pool import BlockPool  # noqa: E402
from streamchat.cache.manager import KVCacheManager  # noqa: E402
from streamchat.config import CacheConfig  # noqa: E402
from streamchat.kernels.backend import TritonBackend  # noqa: E402
from streamchat.model.attention import CpuBackend, TorchBackend  # noqa: E402
from streamchat.model.batch import SeqChunk, StepBatch  # noqa: E402
from streamchat.model.runner import ModelRunner  # noqa: E402
from tests.model.deepseek_kit import hf_model, one_thread, ours  # noqa: E402,F401 (one_thread: autouse)


def mixed_steps(runners, block_size):
    """Two prompts; an append that evicts beside a decode; two decodes: each step's logits per runner."""
    mgr = KVCacheManager(BlockPool(24), block_size, sink_tokens=block_size, window_tokens=3 * block_size)
    seqs = [mgr.new_seq(), mgr.new_seq()]
    gen = torch.Generator().manual_seed(1)

    def chunk(seq, num_tokens):
        ids = torch.randint(0, 300, (num_tokens,), generator=gen).tolist()
        placed = mgr.append(seq, ids)
        return SeqChunk(ids, placed.positions, placed.slots, list(seq.block_ids), True)

    steps = [StepBatch(prefill=[chunk(seqs[0], 40), chunk(seqs[1], 30)]),
             StepBatch(decode=[chunk(seqs[1], 1)], prefill=[chunk(seqs[0], 30)]),
             StepBatch(decode=[chunk(seqs[0], 1), chunk(seqs[1], 1)]),
             StepBatch(decode=[chunk(seqs[0], 1), chunk(seqs[1], 1)])]
    assert seqs[0].evicted_tokens > 0
    return [[r.execute(step) for r in runners] for step in steps]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("backend", [CpuBackend, TritonBackend])
def test_mla_steps_match_the_torch_backend(backend, kv_dtype):
    """Every step's logits within float32 rounding of the torch backend's, and the pools alike."""
    hf = hf_model("v3", vocab=300)
    cache = CacheConfig(block_size=16, num_blocks=24, kv_dtype=kv_dtype)
    runners = [ModelRunner(ours(hf, b()), cache) for b in (TorchBackend, backend)]
    for want, got in mixed_steps(runners, 16):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for want, got in zip(*(r.kv_caches for r in runners)):
        torch.testing.assert_close(got.latent.float(), want.latent.float(), atol=1e-5, rtol=0)
