"""Tests of rope scaling with an attention factor (YaRN) on the Llama path: prefill and decode both equal
transformers (the factor squared on every score, whatever the rotations the keys went through)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig
from streamchat.model.attention import TorchBackend
from streamchat.model.llama import LlamaModel
from streamchat.model.runner import LoadedModel, ModelRunner
from tests.model.deepseek_kit import feed, one_thread  # noqa: F401 (one_thread: autouse)


@pytest.mark.parametrize("chunk", [80, 7, 1])
def test_yarn_llama_logits_match_transformers(chunk):
    """A Llama with YaRN (factor 4: attention factor 1.139): 80 tokens in one piece, in chunks of 7 and
    one by one, within 1e-4 of transformers."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.1,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 256})
    hf = LlamaForCausalLM(config).eval()
    model = LlamaModel(config, hf.state_dict(), torch.float32, torch.device("cpu"), TorchBackend())
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(LoadedModel(None, config, None, model), CacheConfig(block_size=16, num_blocks=9))
    mgr = KVCacheManager(BlockPool(9), 16, 4, 1 << 20)
    seq = mgr.new_seq()
    ours = torch.cat([feed(runner, mgr, seq, ids[i:i + chunk], decode=chunk == 1) for i in range(0, 80, chunk)])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
