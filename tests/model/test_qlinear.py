"""Tests for the weight formats: each against a dense reference, GGUF Q4_1 exactness, the bundled model, auto."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from streamchat.config import ConfigError, ModelConfig
from streamchat.evaluate import read_text
from streamchat.model import weights_auto
from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig
from streamchat.model.attention import TorchBackend
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.gguf_raw import RawTensor, hf_name, linear_weights, unpermute_rows
from streamchat.model.llama import LlamaModel, load_state
from streamchat.model.qlinear import DenseLinear, Int4Linear, Int8Linear, minmax_codes, q4_0_codes, q4_1_codes
from streamchat.model.runner import LoadedModel, ModelRunner, load_model
from streamchat.model.weights import GGUF_INT4, LinearBuilder, check_device, served_fingerprint
from streamchat.model.weights_auto import Measured, choose, decision_path, pick


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def logits_of(loaded, token_ids, block_size=16):
    """Our logits (T, vocab) for every position, all tokens prefilled in one step."""
    num_blocks = len(token_ids) // block_size + 2
    runner = ModelRunner(loaded, CacheConfig(block_size=block_size, num_blocks=num_blocks))
    mgr = KVCacheManager(BlockPool(num_blocks), block_size, 4, 1 << 20)
    seq = mgr.new_seq()
    placed = mgr.append(seq, token_ids)
    ids, pos, meta, _ = runner.prepare(StepBatch(prefill=[SeqChunk(token_ids, placed.positions, placed.slots,
                                                                   list(seq.block_ids), True)]))
    return loaded.model.forward(ids, pos, meta, runner.kv_caches, torch.arange(len(token_ids)))


def kl(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """KL(ref || out) per row of logits."""
    p = ref.log_softmax(-1)
    return (p.exp() * (p - out.log_softmax(-1))).sum(-1)  # (T,)


# -- the kernels' conventions ------------------------------------------------------

def test_int4_kernel_convention():
    """torch's CPU int4 kernel computes W = (q - 8) * scale + zero, sz laid out (K/32, N, 2)."""
    n, k = 48, 96
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    scale, zero = randn(k // 32, n).abs() + 0.1, randn(k // 32, n, seed=2)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = randn(3, k, seed=3)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.stack([scale, zero], -1))
    w = (q - 8) * scale.t().repeat_interleave(32, 1) + zero.t().repeat_interleave(32, 1)  # (N, K)
    torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-5)


def test_int8_kernel_convention():
    """torch's int8 kernel computes W[n] = q[n] * scale[n]."""
    q = torch.randint(-127, 128, (40, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    scale, x = randn(40).abs(), randn(5, 64, seed=2)
    y = torch.ops.aten._weight_int8pack_mm(x, q, scale)
    torch.testing.assert_close(y, x @ (q.float() * scale[:, None]).t(), atol=1e-4, rtol=1e-5)


# -- each format against a dense reference ---------------------------------------------

def test_dense_is_f_linear():
    """DenseLinear is F.linear, bias included, bit for bit."""
    w, b, x = randn(24, 64), randn(24, seed=1), randn(2, 5, 64, seed=2)
    assert torch.equal(DenseLinear(w, b)(x), F.linear(x, w, b))


def test_int8_quantize_error_is_half_a_step():
    """Per output channel: scale = max|w| / 127, every weight within scale / 2 of its code."""
    w = randn(40, 64)
    lin = Int8Linear.quantize(w, compute_dtype=torch.float32)
    torch.testing.assert_close(lin.scale, w.abs().amax(1) / 127)
    err = (lin.q.float() * lin.scale[:, None] - w).abs()
    assert (err <= lin.scale[:, None] / 2 + 1e-7).all()


def within_bf16_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> bool:
    """|y - (x @ w.T + b)| <= 2^-7 * (|x| @ |w|.T): each product off by at most x's and w's bfloat16 rounding."""
    bound = 2.0 ** -7 * (x.abs() @ w.abs().t()) + 1e-5
    return bool(((y - F.linear(x, w, b)).abs() <= bound).all())


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_its_dequantized_weight(compute_dtype):
    """x @ (q * scale).T + bias for (2, 5, K) inputs, float32 out: to 1e-4 in float32, to bf16 rounding in bf16."""
    w, b, x = randn(40, 64), randn(40, seed=1), randn(2, 5, 64, seed=2)
    lin = Int8Linear.quantize(w, b, compute_dtype)
    deq = lin.q.float() * lin.scale.float()[:, None]
    y = lin(x)
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    if compute_dtype == torch.float32:
        torch.testing.assert_close(y, F.linear(x, deq, b), atol=1e-4, rtol=0)
    else:
        assert within_bf16_rounding(y, x, deq, b)


def test_minmax_codes_keep_each_group_min_and_max():
    """Groups of 32: the min is code 0 and the max code 15, exactly; every weight within scale / 2."""
    w = randn(16, 64)
    c = minmax_codes(w)
    deq = c.dequantize().view(16, 2, 32)
    groups = w.view(16, 2, 32)
    torch.testing.assert_close(deq.amin(-1), groups.amin(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(deq.amax(-1), groups.amax(-1), atol=1e-6, rtol=0)
    assert ((deq - groups).abs() <= c.scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("n", [48, 40])  # 40: rows padded to 48 for the packer, sliced off again
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_its_dequantized_weight(n, compute_dtype):
    """x @ W.T + bias for (2, 5, K) inputs, float32 out: to 1e-4 in float32, to bf16 rounding in bf16."""
    w, b, x = randn(n, 64), randn(n, seed=1), randn(2, 5, 64, seed=2)
    c = minmax_codes(w)
    y = Int4Linear(c, b, compute_dtype)(x)
    assert y.shape == (2, 5, n) and y.dtype == torch.float32
    if compute_dtype == torch.float32:
        torch.testing.assert_close(y, F.linear(x, c.dequantize(), b), atol=1e-4, rtol=0)
    else:
        assert within_bf16_rounding(y, x, c.dequantize(), b)


def test_int4_refuses_in_features_off_the_group():
    """in_features not a multiple of 32 is a ValueError naming it."""
    with pytest.raises(ValueError, match="divisible by 32, got 48"):
        Int4Linear.quantize(randn(16, 48))


# -- GGUF blocks -----------------------------------------------------------------------

@pytest.mark.parametrize("qtype,decode", [(GGMLQuantizationType.Q4_1, q4_1_codes),
                                          (GGMLQuantizationType.Q4_0, q4_0_codes)])
def test_gguf_blocks_decode_exactly(qtype, decode):
    """Q4_1 / Q4_0 rows decode to gguf's own dequantization bit for bit; x @ W.T within float error."""
    w = randn(48, 128).numpy()
    raw = quantize(w, qtype)  # (48, 4 blocks * bytes)
    ref = torch.from_numpy(dequantize(raw, qtype))
    codes = decode(torch.from_numpy(raw))
    assert torch.equal(codes.dequantize(), ref)
    x = randn(7, 128, seed=1)
    torch.testing.assert_close(Int4Linear(codes, compute_dtype=torch.float32)(x), x @ ref.t(), atol=1e-4, rtol=0)


def test_unpermute_rows_is_transformers_conversion():
    """q and k rows come back in the order transformers' GGUF conversion gives (9 heads, and 3 KV heads)."""
    rows = np.arange(576 * 2, dtype=np.float32).reshape(576, 2)
    processor = LlamaTensorProcessor()
    for heads in (9, 3):
        part = rows[: heads * 64]
        expected = processor._reverse_permute_weights(part, heads, heads)
        assert torch.equal(unpermute_rows(torch.from_numpy(part), heads), torch.from_numpy(expected))


def test_gguf_names():
    """Linear weights map to the converted folder's names; norms and unknown tensors map to None."""
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_norm.weight") is None and hf_name("rope_freqs") is None


# -- formats in the model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


def tiny_loaded(hf, weights, head=None):
    model = LlamaModel(hf.config, hf.state_dict(), torch.float32, torch.device("cpu"), TorchBackend(),
                       LinearBuilder(weights, head=head))
    return LoadedModel(None, hf.config, None, model, weights)


def kinds(model) -> tuple[set[str], str]:
    """The projections' class names and the head's."""
    projections = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return {type(lin).__name__ for lin in projections}, type(model.lm_head).__name__


def test_builder_formats_per_tensor(tiny_hf):
    """bf16: all dense; int8: all int8; int4: projections int4, head int8 (the override wins)."""
    assert kinds(tiny_loaded(tiny_hf, "bf16").model) == ({"DenseLinear"}, "DenseLinear")
    assert kinds(tiny_loaded(tiny_hf, "int8").model) == ({"Int8Linear"}, "Int8Linear")
    assert kinds(tiny_loaded(tiny_hf, "int4").model) == ({"Int4Linear"}, "Int8Linear")
    assert kinds(tiny_loaded(tiny_hf, "int4", head="bf16").model) == ({"Int4Linear"}, "DenseLinear")


def test_builder_falls_back_when_blocks_disagree(tiny_hf, caplog):
    """A GGUF tensor that does not decode to the dense weight is quantized from the dense weight instead."""
    state = tiny_hf.state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    wrong = quantize(state[name].numpy() + 1, GGMLQuantizationType.Q4_1)
    builder = LinearBuilder("int4", {name: RawTensor("Q4_1", torch.from_numpy(wrong))})
    codes = builder._codes(state, name)
    assert torch.equal(codes.codes, minmax_codes(state[name]).codes)
    assert "do not decode to the converted weight" in caplog.text


# Measured: int8 max |d logit| 0.0068, mean KL 9.4e-7; int4 (min/max from random
# weights, coarse) 0.072 and 9.0e-5, against logits up to 0.67 in size.
@pytest.mark.parametrize("weights,max_diff,mean_kl", [("int8", 0.02, 1e-5), ("int4", 0.15, 5e-4)])
def test_quantized_tiny_model_logits(tiny_hf, weights, max_diff, mean_kl):
    """Tiny random Llama, 64 tokens: logits and their KL to dense within the measured bounds above."""
    ids = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = logits_of(tiny_loaded(tiny_hf, "bf16"), ids)
    out = logits_of(tiny_loaded(tiny_hf, weights), ids)
    assert (out - ref).abs().max() < max_diff
    assert kl(ref, out).mean() < mean_kl


def test_device_check_and_fingerprint():
    """int8/int4 refuse a CUDA device with a ConfigError; bf16 and auto pass; quantized fingerprints differ."""
    for weights in ("int8", "int4"):
        with pytest.raises(ConfigError, match=f"--weights {weights} runs on CPU only"):
            check_device(weights, torch.device("cuda"))
        check_device(weights, torch.device("cpu"))
    check_device("bf16", torch.device("cuda"))
    check_device("auto", torch.device("cuda"))
    assert served_fingerprint("abc", "bf16") == "abc"
    assert served_fingerprint("abc", "int4") == "abc+int4"


def test_load_model_refuses_int4_on_cuda_before_loading(monkeypatch):
    """load_model with the device monkeypatched to CUDA fails fast: nothing resolved, nothing read."""
    from streamchat.model import runner

    monkeypatch.setattr(runner, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(runner, "resolve", lambda *a: pytest.fail("resolved a model"))
    with pytest.raises(ConfigError, match="--weights int4 runs on CPU only"):
        load_model(ModelConfig(weights="int4"))


def test_config_validates_weights():
    """ModelConfig.weights is one of auto, bf16, int8, int4; the default is bf16."""
    assert ModelConfig().weights == "bf16"
    for weights in ("auto", "bf16", "int8", "int4"):
        ModelConfig(weights=weights).validate()
    with pytest.raises(ConfigError, match="weights must be one of auto, bf16, int8, int4; got 'int3'"):
        ModelConfig(weights="int3").validate()


# -- auto --------------------------------------------------------------------------------

def test_pick_is_the_fastest_within_one_percent():
    """int4 is fastest but 1.2% worse: int8 (0.5% worse, faster than dense) wins; ties to dense if none fits."""
    m = {"bf16": Measured(20.0, 100.0), "int8": Measured(20.1, 80.0), "int4": Measured(20.24, 50.0)}
    assert pick(m) == "int8"
    m["int4"] = Measured(20.2, 50.0)  # exactly 1%
    assert pick(m) == "int4"
    assert pick({"bf16": Measured(20.0, 100.0), "int8": Measured(30.0, 10.0)}) == "bf16"


def test_auto_measures_once_and_reuses_the_cached_decision(tmp_path):
    """The first call measures and writes JSON beside the models; the second reads it without measuring."""
    calls = []

    def measure():
        calls.append(1)
        return {"bf16": Measured(20.0, 100.0), "int8": Measured(20.05, 70.0), "int4": Measured(20.1, 40.0)}

    path = decision_path(tmp_path, "fp123", torch.device("cpu"), torch.float32)
    assert path == tmp_path / "weights-auto" / "fp123-cpu-float32.json"
    assert choose(path, torch.device("cpu"), measure) == "int4"
    record = json.loads(path.read_text())
    assert record["choice"] == "int4" and record["measured"]["int8"] == {"ppl": 20.05, "decode_ms": 70.0}
    assert choose(path, torch.device("cpu"), measure) == "int4"
    assert calls == [1]
    path.write_text("{not json")  # unreadable: measured again
    assert choose(path, torch.device("cpu"), measure) == "int4" and calls == [1, 1]


def test_auto_on_cuda_is_dense_without_measuring(tmp_path):
    """Off the CPU auto is bf16 and measures nothing."""
    path = decision_path(tmp_path, "fp", torch.device("cuda"), torch.bfloat16)
    assert choose(path, torch.device("cuda"), lambda: pytest.fail("measured")) == "bf16"
    assert not path.exists()


def test_auto_measure_runs_every_format(tiny_hf, monkeypatch):
    """measure() on a tiny model: a finite perplexity and a positive step time for bf16, int8 and int4."""
    from streamchat import autotune

    monkeypatch.setattr(autotune, "DECODE_STEPS", 2)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    measured = autotune._measure(lambda fmt: tiny_loaded(tiny_hf, fmt), ids)
    assert list(measured) == ["bf16", "int8", "int4"]
    for m in measured.values():
        assert 1 < m.ppl < 1e4 and m.decode_ms > 0


# -- the bundled model (marked slow: they load it) ---------------------------------------------

@pytest.fixture(scope="module")
def bundled_raw(bundled_fp32):
    src = bundled_fp32.source
    return linear_weights(src.gguf, src.folder, bundled_fp32.hf_config, GGUF_INT4)


@pytest.mark.slow
def test_bundled_blocks_are_the_converted_weights(bundled_fp32, bundled_raw):
    """All 210 projections are Q4_1 and decode, rows un-permuted, bit for bit to the cached dense weights."""
    state = load_state(bundled_fp32.source.folder)
    assert len(bundled_raw) == 30 * 7 and {r.qtype for r in bundled_raw.values()} == {"Q4_1"}
    for name, raw in bundled_raw.items():
        assert torch.equal(q4_1_codes(raw.data).dequantize(), state[name]), name


@pytest.fixture(scope="module")
def bundled_case(bundled_fp32, bundled_raw):
    """The first 128 tokens of Botchan, the dense model's logits, and a maker of other formats on the same state."""
    state = load_state(bundled_fp32.source.folder)
    ids = bundled_fp32.tokenizer(read_text(None))["input_ids"][:128]

    def loaded(weights, head=None, compute_dtype=torch.bfloat16):
        builder = LinearBuilder(weights, bundled_raw, compute_dtype, head)
        model = LlamaModel(bundled_fp32.hf_config, state, torch.float32, torch.device("cpu"), TorchBackend(),
                           builder)
        return LoadedModel(bundled_fp32.source, bundled_fp32.hf_config, bundled_fp32.tokenizer, model, weights)

    return ids, logits_of(bundled_fp32, ids), loaded


# float32's floor over 30 layers: measured 2.1e-4 on all 128 tokens; test_llama
# allows 2.5e-4 between our dense logits and transformers'. 8 tokens: the float32
# kernel is the slow one (see qlinear; minutes for 48 tokens on an AVX2-only CPU).
@pytest.mark.slow
def test_bundled_int4_in_float32_is_the_dense_model(bundled_case):
    """int4 from the GGUF's blocks, float32 compute, dense head: logits within 5e-4 of dense, argmax equal."""
    ids, ref, loaded = bundled_case
    out = logits_of(loaded("int4", head="bf16", compute_dtype=torch.float32), ids[:8])
    assert (out - ref[:8]).abs().max() < 5e-4
    assert torch.equal(out.argmax(-1), ref[:8].argmax(-1))


# Measured on these 128 tokens: int4 (bf16 compute, int8 head) max |d logit| 0.99,
# mean KL 0.0029, argmax 97.7% equal (dense head: 0.80, 0.0013, 100%); int8 3.61,
# 0.016, 89.8% (per-channel int8 of the Q4_1 weights re-quantizes them coarsely).
@pytest.mark.slow
@pytest.mark.parametrize("weights,max_diff,mean_kl,agree", [("int4", 1.5, 0.005, 0.95),
                                                            ("int8", 5.0, 0.025, 0.85)])
def test_bundled_quantized_logits_are_close(bundled_case, weights, max_diff, mean_kl, agree):
    """As served (bfloat16 compute, int8 head): logits close to dense within the measured bounds above."""
    ids, ref, loaded = bundled_case
    out = logits_of(loaded(weights), ids)
    assert (out - ref).abs().max() < max_diff
    assert kl(ref, out).mean() < mean_kl
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agree


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_bundled_greedy_text(weights):
    """Served quantized through load_model and the engine, the bundled model still knows Paris."""
    from streamchat.config import CacheConfig, Config
    from streamchat.llm import LLM

    llm = LLM(Config(model=ModelConfig(dtype="float32", weights=weights), cache=CacheConfig(window_tokens=256, num_blocks=64)))
    assert llm.loaded.weights == weights and llm.loaded.source.fingerprint.endswith("+" + weights)
    [reply] = llm.chat(["What is the capital of France?"], max_tokens=12)
    assert "Paris" in reply.text


@pytest.mark.slow
def test_bfloat16_decode_rows_multiply_the_unrounded_groups(bundled_fp32, bundled_raw):
    """In bfloat16 on CPU, a projection keeps the GGUF's groups (they decode to its weight once rounded):
    up to BF16_GROUP_ROWS rows multiply them in float32 and round the result (twice the bf16 GEMM's
    speed for one session, measured); more rows take the bf16 GEMM, and both agree to bf16's precision."""
    from kernel_build import require_kernels

    from streamchat.model.qlinear import BF16_GROUP_ROWS

    require_kernels()
    state = load_state(bundled_fp32.source.folder)
    names = ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    w = {n: state[n].to(torch.bfloat16) for n in names}
    builder = LinearBuilder("bf16", bundled_raw)
    lin = builder.layer(w, names)
    assert isinstance(lin, DenseLinear) and lin.groups is not None and lin.few_rows == BF16_GROUP_ROWS > 0
    assert builder.mismatches == 0
    x = torch.randn(BF16_GROUP_ROWS + 1, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    few, many = lin(x[:BF16_GROUP_ROWS]), lin(x)
    assert torch.equal(few, lin.groups.matmul(x[:BF16_GROUP_ROWS].float()).to(torch.bfloat16))
    assert torch.equal(many, F.linear(x, lin.weight))
    torch.testing.assert_close(few.float(), many[:BF16_GROUP_ROWS].float(), atol=0.05, rtol=0.02)
    w[names[0]] = w[names[0]].clone()
    w[names[0]][0, 0] += 1  # a weight the blocks do not decode to: no groups, the GEMM for every row
    other = LinearBuilder("bf16", bundled_raw)
    assert other.layer(w, names).groups is None and other.mismatches == 1


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch without oneDNN: F.linear serves")
def test_bfloat16_batches_multiply_the_weight_reordered_once_with_the_same_bits(monkeypatch):
    """A bf16 DenseLinear on CPU keeps W in oneDNN's layout from the start (F.linear reorders it on every
    call): every batch size, a prefill's included, takes that path and gives F.linear's bits exactly, and
    W itself is still there to be had."""
    from streamchat.model import qlinear

    g = torch.Generator().manual_seed(3)
    weights = {(n, k): torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in ((1536, 576), (576, 1536),
                                                                                       (4000, 576))}
    cases = [(DenseLinear(w.clone()), n, k) for (n, k), w in weights.items()]
    for lin, n, k in cases:
        assert torch.equal(lin.weight, weights[n, k]) and lin.nbytes == weights[n, k].nbytes
    xs = {m: torch.randn(m, 1536, generator=g).to(torch.bfloat16) for m in (1, 5, 16, 33, 300)}
    expected = {(n, m): F.linear(xs[m][:, :k], weights[n, k]) for _, n, k in cases for m in xs}
    monkeypatch.setattr(qlinear.F, "linear", lambda *a, **kw: pytest.fail("F.linear ran: W reordered per call"))
    for lin, n, k in cases:
        assert lin.packed is not None and lin.few_rows == 0
        for m, x in xs.items():
            assert torch.equal(lin(x[:, :k]), expected[n, m]), (n, k, m)
    assert qlinear.packed_bf16(torch.randn(8, 32)) is None  # float32 keeps its own paths
