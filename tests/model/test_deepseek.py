"""Tests of our DeepSeek-V2/V3 forward pass: logits and greedy tokens equal transformers', batches equal
each session alone, and the architecture registry."""

import pytest
import torch
from deepseek_kit import feed, hf_model, one_thread, ours, save_folder  # noqa: F401 (one_thread: autouse)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, Config, ModelConfig
from streamchat.llm import LLM
from streamchat.model import registry
from streamchat.model.loader import ModelLoadError, resolve
from streamchat.model.moe import Router
from streamchat.model.runner import ModelRunner


@pytest.fixture(scope="module", params=["v2", "v3"])
def pair(request):
    """(transformers' model, ours on its weights) for V2-Lite's attention shape and the V3 style."""
    hf = hf_model(request.param, vocab=300)
    return hf, ours(hf)


def run_logits(loaded, token_ids, chunk, block_size=16):
    """Our logits for every position, feeding `chunk` tokens per step (1: the absorbed decode path)."""
    num_blocks = len(token_ids) // block_size + 4
    runner = ModelRunner(loaded, CacheConfig(block_size=block_size, num_blocks=num_blocks))
    mgr = KVCacheManager(BlockPool(num_blocks), block_size, 4, 1 << 20)
    seq = mgr.new_seq()
    return torch.cat([feed(runner, mgr, seq, token_ids[i:i + chunk], decode=chunk == 1)
                      for i in range(0, len(token_ids), chunk)])


@pytest.mark.parametrize("chunk", [80, 7, 1])
def test_logits_match_transformers(pair, chunk):
    """80 tokens (five blocks) in one piece, in chunks of 7, and one by one: within 1e-4 of transformers."""
    hf, loaded = pair
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(run_logits(loaded, ids, chunk), ref, atol=1e-4, rtol=0)


def test_biases_and_plain_rope_match_transformers():
    """A V3-style model with attention biases (q_a_proj, kv_a_proj_with_mqa), rotate-half rope
    (rope_interleave off) and no YaRN: logits within 1e-4, prefill and decode."""
    hf = hf_model("v3", vocab=300, attention_bias=True, rope_interleave=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.no_grad():
        for layer in hf.model.layers:  # biases start at zero: make them count
            for proj in (layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa):
                proj.bias.normal_(0, 0.5)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    loaded = ours(hf)
    for chunk in (40, 1):
        torch.testing.assert_close(run_logits(loaded, ids, chunk), ref, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers_generate(pair):
    """A 20-token prompt, then 24 greedy tokens by prefill + absorbed decode: transformers' own."""
    hf, loaded = pair
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                           pad_token_id=0)[0, 20:].tolist()
    runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=8))
    mgr = KVCacheManager(BlockPool(8), 16, 4, 1 << 20)
    seq = mgr.new_seq()
    got = [int(feed(runner, mgr, seq, prompt)[-1].argmax())]
    while len(got) < 24:
        got.append(int(feed(runner, mgr, seq, got[-1:], decode=True)[0].argmax()))
    assert got == want


@pytest.fixture(scope="module")
def v2_folder(tmp_path_factory):
    """A DeepSeek-V2-Lite-shaped model folder with the bundled tokenizer and chat template."""
    return save_folder(hf_model("v2"), tmp_path_factory.mktemp("dsv2"), resolve(None).folder)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_of_sessions_equals_each_alone(v2_folder, backend):
    """Three chats batched (prefill and decode rows together) give the tokens each gives alone."""
    one_thread = torch.get_num_threads()
    llm = LLM(Config(model=ModelConfig(path=str(v2_folder), dtype="float32", attention_backend=backend,
                                       num_threads=one_thread),
                     cache=CacheConfig(num_blocks=64, window_tokens=256)))
    assert type(llm.loaded.model).__name__ == "DeepseekModel"
    prompts = ["Hello there.", "Name three colours of the rainbow please.", "Why?"]
    together = [r.token_ids for r in llm.chat(prompts, max_tokens=12)]
    alone = [llm.chat([p], max_tokens=12)[0].token_ids for p in prompts]
    assert together == alone and all(len(t) > 0 for t in together)


def test_unknown_model_type_is_refused_naming_the_supported(tmp_path):
    """A config.json of another architecture is a ConfigError at start-up that lists what is served."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(registry.UnsupportedArchitecture) as err:
        resolve(str(tmp_path))
    assert str(err.value) == (f"{tmp_path} holds a 'gpt2' model; supported: "
                              "deepseek_v2, deepseek_v3, llama, mistral, qwen2")
    assert registry.model_class("qwen2").__name__ == "LlamaModel"
    assert registry.model_class("deepseek_v3").__name__ == "DeepseekModel"


def test_group_limited_greedy_routes_as_transformers():
    """DeepSeek-V2's group-limited routing: the same experts and weights as transformers' router."""
    hf = hf_model("v2", vocab=300)
    config = hf.config
    config.topk_method, config.n_group, config.topk_group, config.routed_scaling_factor = \
        "group_limited_greedy", 4, 2, 1.5
    theirs = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    x = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(3))
    _, their_w, their_e = theirs(x)
    our_w, our_e = Router(config, theirs.weight.detach(), None, sigmoid=False)(x)
    order_t, order_o = their_e.sort(-1), our_e.sort(-1)
    assert torch.equal(order_t.values, order_o.values)
    torch.testing.assert_close(our_w.gather(1, order_o.indices), their_w.detach().gather(1, order_t.indices))


def test_quantized_checkpoints_are_refused_before_loading(tmp_path):
    """A folder of quantized weights (DeepSeek-V3 ships fp8 blocks with scale tensors) is refused, named."""
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "quantization_config": '
                                          '{"quant_method": "fp8", "weight_block_size": [128, 128]}}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="holds fp8-quantized weights, which this runner does not read"):
        resolve(str(tmp_path))
