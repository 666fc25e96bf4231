"""`--kv-dtype auto` (model/kv_auto.py, autotune.resolve_kv_dtype): the pick, its reason, its cache, and an
explicit --kv-dtype left alone."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamchat import autotune
from streamchat.config import CacheConfig
from streamchat.model.attention import TorchBackend
from streamchat.model.kv_auto import CANDIDATES, KvMeasured, choose, pick
from streamchat.model.llama import LlamaModel
from streamchat.model.runner import ModelRunner
from streamchat.model.weights import LinearBuilder

BOUNDS = "perplexity +0.5% and step +5% of float's"


def measured(int8_ppl: float = 20.004, int8_ms: float = 102.0) -> dict[str, KvMeasured]:
    return {"float": KvMeasured(20.0, 100.0, 1000), "int8": KvMeasured(int8_ppl, int8_ms, 260),
            "fp8": KvMeasured(20.05, 101.0, 260), "int4": KvMeasured(21.0, 90.0, 140)}


def test_pick_takes_the_fewest_bytes_within_both_bounds():
    """int4 is smaller but costs 5% perplexity; int8 and fp8 take the same bytes, int8 the lower perplexity."""
    choice = pick(measured())
    assert choice.kv_dtype == "int8"
    assert choice.reason == (f"auto chose int8, the fewest bytes within {BOUNDS}: perplexity +0.02%, "
                             "step +2.0%, 26% of the bytes; also measured int4 (perplexity +5.00%, step -10.0%, "
                             "14% of the bytes), fp8 (perplexity +0.25%, step +1.0%, 26% of the bytes)")


@pytest.mark.parametrize("int8_ppl,int8_ms", [(20.0, 106.0), (20.2, 100.0)], ids=["slower", "worse"])
def test_pick_falls_to_the_next_storage_and_then_float(int8_ppl, int8_ms):
    """int8 past one bound leaves fp8 (same bytes); with fp8 past one too, float."""
    assert pick(measured(int8_ppl, int8_ms)).kv_dtype == "fp8"
    both = measured(int8_ppl, int8_ms) | {"fp8": KvMeasured(20.5, 100.0, 260)}
    choice = pick(both)
    assert choice.kv_dtype == "float" and choice.reason.startswith(f"auto chose float: no smaller storage within "
                                                                   f"{BOUNDS}; also measured int4")


def test_a_storage_past_the_perplexity_bound_is_not_timed():
    """measure_kv_dtypes times only what could be chosen; pick says so."""
    choice = pick(measured() | {"int4": KvMeasured(21.0, None, 140)})
    assert choice.kv_dtype == "int8" and "int4 (perplexity +5.00%, step not timed, 14% of the bytes)" in choice.reason


def test_choose_measures_once_and_says_so_from_the_cache(tmp_path):
    calls = []
    path = tmp_path / "kv-auto" / "fp.json"
    first = choose(path, lambda: calls.append(1) or measured())
    again = choose(path, lambda: pytest.fail("measured twice"))
    assert calls == [1] and first.kv_dtype == again.kv_dtype == "int8"
    assert again.reason == f"{first.reason} (measured earlier: {path})"
    assert json.loads(path.read_text())["measured"]["int8"] == {"ppl": 20.004, "step_ms": 102.0,
                                                                "bytes_per_token": 260}


@pytest.fixture
def tiny(monkeypatch):
    """A two-layer random Llama as load_model would hand it over, and the workload shrunk to fit it."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    model = LlamaModel(hf.config, hf.state_dict(), torch.float32, torch.device("cpu"), TorchBackend(),
                       LinearBuilder("bf16"))
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(autotune, "read_text", lambda path: "")
    monkeypatch.setattr(autotune, "tokenize", lambda tokenizer, text, n: ids)
    monkeypatch.setattr(autotune, "DECODE_STEPS", 2)
    monkeypatch.setattr(autotune, "LONGCHAT_SESSIONS", 2)
    monkeypatch.setattr(autotune, "LONGCHAT_TOKENS", 40)
    return SimpleNamespace(source=SimpleNamespace(fingerprint="tiny"), model=model, tokenizer=None)


def test_auto_resolves_to_a_measured_dtype_with_its_reason(tiny, tmp_path):
    """Every storage the model's shape takes, measured on the model itself; the runner built from the result
    stores it and says why."""
    cache, reason = autotune.resolve_kv_dtype(tiny, CacheConfig(kv_dtype="auto"), str(tmp_path))
    assert cache.kv_dtype in CANDIDATES and reason.startswith(f"auto chose {cache.kv_dtype}")
    record = json.loads((tmp_path / "kv-auto" / "tiny-cpu-float32-torch.json").read_text())
    assert record["choice"] == cache.kv_dtype
    assert set(record["measured"]) == {"float", "int8", "fp8"}  # int4 refuses a head_dim of 16 (ConfigError)
    for name, m in record["measured"].items():  # timed: float and those within the perplexity bound
        fits = m["ppl"] <= record["measured"]["float"]["ppl"] * 1.005
        assert 1 < m["ppl"] < 1e4 and (m["step_ms"] > 0 if fits else m["step_ms"] is None), name
    assert record["measured"]["int8"]["bytes_per_token"] < record["measured"]["float"]["bytes_per_token"]
    runner = ModelRunner(tiny, CacheConfig(kv_dtype=cache.kv_dtype, num_blocks=8), kv_dtype_reason=reason)
    assert (runner.kv_dtype, runner.kv_dtype_reason) == (cache.kv_dtype, reason)


@pytest.mark.parametrize("kv_dtype", ["float", "int8", "fp8", "int4"])
def test_an_explicit_kv_dtype_is_honoured_without_measuring(tiny, tmp_path, monkeypatch, kv_dtype):
    monkeypatch.setattr(autotune, "measure_kv_dtypes", lambda *a: pytest.fail("measured"))
    cache, reason = autotune.resolve_kv_dtype(tiny, CacheConfig(kv_dtype=kv_dtype), str(tmp_path))
    assert cache == CacheConfig(kv_dtype=kv_dtype) and reason == f"as configured (--kv-dtype {kv_dtype})"
    assert not (tmp_path / "kv-auto").exists()
