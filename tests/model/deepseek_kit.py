"""Random-weight DeepSeek models for the tests: transformers' own classes (the oracle), ours on the
same weights, and model folders a daemon can serve (the tokenizer and chat template of the bundled model).

Shapes: V2-Lite's real attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, no q_lora_rank, YaRN as its config gives it) with a hidden size of 64 and three layers (one
dense, two mixture-of-experts, greedy routing); and a V3-style model with a query low-rank projection,
grouped sigmoid routing, interleaved rope and YaRN whose attention factor is not 1.
"""

import shutil

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 49152  # the bundled tokenizer's

V2_LITE = dict(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, q_lora_rank=None, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=2560,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
                                "beta_fast": 32, "beta_slow": 1})
V3_STYLE = dict(num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                q_lora_rank=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
                topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=1024,
                rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.5,
                                 "beta_fast": 32, "beta_slow": 1})


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one torch thread runs these small steps about ten times faster than two
    threads contending with the rest of the machine (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_model(kind: str, seed: int = 0, vocab: int = VOCAB, **changes):
    """transformers' DeepseekV2/V3ForCausalLM of random weights (std 0.1: attention far from uniform);
    `changes` override the shape's config entries."""
    torch.manual_seed(seed)
    if kind == "v2":
        config = DeepseekV2Config(vocab_size=vocab, initializer_range=0.1, tie_word_embeddings=False,
                                  **{**V2_LITE, **changes})
        model = DeepseekV2ForCausalLM(config)
    else:
        config = DeepseekV3Config(vocab_size=vocab, initializer_range=0.1, tie_word_embeddings=False,
                                  **{**V3_STYLE, **changes})
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # the correction bias starts at zero; give the routing something to correct
            for layer in model.model.layers[config.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model.eval()


def save_folder(hf, folder, tokenizer_folder):
    """A model folder: hf's config and safetensors, the bundled model's tokenizer and chat template."""
    hf.save_pretrained(folder)
    for f in tokenizer_folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def ours(hf, backend=None, dtype=torch.float32):
    """Our DeepseekModel on hf's weights (torch backend by default), as a LoadedModel."""
    from streamchat.model.attention import TorchBackend
    from streamchat.model.deepseek import DeepseekModel
    from streamchat.model.runner import LoadedModel

    model = DeepseekModel(hf.config, hf.state_dict(), dtype, torch.device("cpu"), backend or TorchBackend())
    return LoadedModel(None, hf.config, None, model)


def feed(runner, manager, seq, token_ids, decode=False, mass=None):
    """Place token_ids in seq and run them as one chunk (decode: one token); logits (n, vocab)."""
    from streamchat.model.batch import SeqChunk, StepBatch

    placed = manager.append(seq, token_ids)
    c = SeqChunk(token_ids, placed.positions, placed.slots, list(seq.block_ids), True)
    ids, pos, meta, _ = runner.prepare(StepBatch(decode=[c]) if decode else StepBatch(prefill=[c]))
    return runner.model.forward(ids, pos, meta, runner.kv_caches, torch.arange(len(token_ids)), mass)
