"""Tests for decode through the static buffers: padded up to a bucket, the logits of the plain path."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig
from streamchat.model.attention import TorchBackend
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.llama import LlamaModel
from streamchat.model.runner import LoadedModel, ModelRunner
from streamchat.model.static_decode import StaticDecode, bucket_for, buckets

BS = 4  # small blocks: tables of different widths after a few tokens


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).eval()
    model = LlamaModel(config, hf.state_dict(), torch.float32, torch.device("cpu"), TorchBackend())
    return LoadedModel(None, config, None, model)


class Sessions:
    """Three sequences of different lengths in one runner's pool, advanced one token a step."""

    def __init__(self, runner: ModelRunner, lengths=(3, 9, 14)) -> None:
        self.runner = runner
        self.mgr = KVCacheManager(BlockPool(runner.num_blocks), BS, 4, 1 << 20)
        self.seqs = [self.mgr.new_seq() for _ in lengths]
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in lengths]
        runner.execute(StepBatch(prefill=[self._chunk(seq, p) for seq, p in zip(self.seqs, prompts)]))

    def _chunk(self, seq, token_ids) -> SeqChunk:
        placed = self.mgr.append(seq, token_ids)
        return SeqChunk(token_ids, placed.positions, placed.slots, list(seq.block_ids), True)

    def decode(self, token_ids) -> StepBatch:
        return StepBatch(decode=[self._chunk(seq, [t]) for seq, t in zip(self.seqs, token_ids)])


def plain(runner: ModelRunner, batch: StepBatch) -> torch.Tensor:
    ids, pos, meta, rows = runner.prepare(batch)
    return runner.model.forward(ids, pos, meta, runner.kv_caches, rows)


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    """The bucket list ends at max_batch; a batch takes the smallest bucket that holds it."""
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets(1) == [1]
    assert [bucket_for(n, buckets(48)) for n in (1, 3, 5, 17, 33, 48)] == [1, 4, 8, 32, 48, 48]


def test_padded_static_decode_gives_the_plain_paths_logits(loaded):
    """Three sequences padded to a bucket of 4, over steps that widen their tables: the plain logits."""
    cache = CacheConfig(block_size=BS, num_blocks=40, window_tokens=64)
    a, b = ModelRunner(loaded, cache), ModelRunner(loaded, cache)
    static = StaticDecode(a.model, a.kv_caches, BS, max_batch=8, max_blocks=2, graphs=False, pad=True)
    sa, sb = Sessions(a), Sessions(b)
    tokens = [5, 17, 99]
    for _ in range(6):
        batch = sa.decode(tokens)
        got = static.run(batch)
        want = plain(b, sb.decode(tokens))
        assert got.shape == (3, 120)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1).tolist()
    # the padding row: token 0 at the null slot, length 1, a table of null blocks
    assert static.slots[3].item() == 0 and static.seq_lens[3].item() == 1 and static.ids[3].item() == 0
    assert static.tables[3].tolist() == [0] * static.max_blocks
    assert static.max_blocks == 5  # widened from 2: the longest sequence reached 20 tokens


def test_runner_decodes_through_the_static_buffers(loaded):
    """`execute` takes the static path for a decode-only step, unpadded on CPU, with the plain logits."""
    cache = CacheConfig(block_size=BS, num_blocks=40, window_tokens=64)
    a, b = ModelRunner(loaded, cache, max_batch=4), ModelRunner(loaded, cache, max_batch=4)
    sa, sb = Sessions(a), Sessions(b)
    assert not a.static.use_graphs and a.static.sizes == [1, 2, 3, 4]
    batch = sa.decode([1, 2, 3])
    assert a.static.fits(batch)
    torch.testing.assert_close(a.execute(batch), plain(b, sb.decode([1, 2, 3])), atol=1e-5, rtol=0)
    assert a.static.seq_lens[:3].tolist() == [c.seq_len for c in batch.decode]


def test_only_decode_steps_within_the_buffers_fit(loaded):
    """Prefill, more rows than the buffers hold, or a row not sampled: the plain path."""
    runner = ModelRunner(loaded, CacheConfig(block_size=BS, num_blocks=40, window_tokens=64), max_batch=2)
    chunk = SeqChunk([1], [0], [4], [1], True)
    assert runner.static.fits(StepBatch(decode=[chunk, chunk]))
    assert not runner.static.fits(StepBatch(decode=[chunk] * 3))
    assert not runner.static.fits(StepBatch(decode=[chunk], prefill=[chunk]))
    assert not runner.static.fits(StepBatch(decode=[SeqChunk([1], [0], [4], [1], False)]))
    assert not runner.static.fits(StepBatch())


def test_cuda_graphs_refuse_a_cpu_model(loaded):
    """Asking for graphs off CUDA is a clear error, not a silent eager run."""
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticDecode(loaded.model, [], BS, 4, 4, graphs=True)


def test_cuda_graphs_flag_is_ignored_off_cuda(loaded):
    """--cuda-graphs (on by default) asks for graphs only where they exist: a CPU runner decodes eagerly
    through the same buffers and captures nothing (the gpu test in test_kernel_backend checks both
    settings on a device)."""
    cache = CacheConfig(block_size=BS, num_blocks=40, window_tokens=64)
    for graphs in (True, False):
        runner = ModelRunner(loaded, cache, max_batch=2, cuda_graphs=graphs)
        assert runner.static.use_graphs is False and runner.static.graphs == {}
