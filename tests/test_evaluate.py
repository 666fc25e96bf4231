"""Tests for `streamchat eval`: each policy's feeding, the oracle, the JSON report, bad inputs."""

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from streamchat import cli
from streamchat.config import KV_DTYPES, WEIGHTS
from streamchat.evaluate import DEFAULT_TEXT
from streamchat.evaluate_policies import (EvalSpec, policy_cache, recompute_policy, recompute_targets,
                                          stream_nll, streamed_policy)
from streamchat.model.attention import TorchBackend
from streamchat.model.llama import LlamaModel
from streamchat.model.runner import LoadedModel, ModelRunner

BOTCHAN_SHA256 = "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7"


def _tiny_config():
    return LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes gain nothing from threads, and on a busy machine extra threads only spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_hf():
    """A tiny random Llama with grouped-query attention (4 query heads, 2 KV heads), untied."""
    torch.manual_seed(0)
    return LlamaForCausalLM(_tiny_config()).eval()


def _loaded(hf, dtype):
    model = LlamaModel(hf.config, hf.state_dict(), dtype, torch.device("cpu"), TorchBackend())
    return LoadedModel(None, hf.config, None, model)


@pytest.fixture(scope="module")
def tiny(tiny_hf):
    return _loaded(tiny_hf, torch.float32)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1)).tolist()


# block 4, sink 4 (one block), window 16 (four blocks; h2o protects the last one): 90 tokens evict many times
SPEC = EvalSpec(sink_tokens=4, window_tokens=16, block_size=4, recompute_stride=1, h2o_recent_tokens=4)


@pytest.mark.parametrize("policy", ["sink", "window", "full", "h2o"])
def test_chunked_equals_token_by_token(tiny, ids, policy):
    """One block per forward gives the NLLs that one token per forward (the decode path) gives."""
    chunked = streamed_policy(tiny, policy, ids, SPEC)
    one_by_one = streamed_policy(tiny, policy, ids, SPEC, chunk=1)
    assert chunked.nll.shape == (89,) and torch.equal(chunked.targets, torch.arange(89))
    torch.testing.assert_close(chunked.nll, one_by_one.nll, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy,sink_blocks", [("sink", 1), ("window", 0)])
def test_policy_cache_keeps_sinks_and_window(tiny, ids, policy, sink_blocks):
    """After the stream, `sink` holds the first block plus the window; `window` only the window."""
    cache = policy_cache(policy, len(ids), SPEC)
    runner = ModelRunner(tiny, _cache_cfg(cache.num_blocks))
    stream_nll(runner, cache.manager, cache.seq, ids, cache.chunk)
    fed = ids[:-1]  # 89 tokens: 22 full blocks and one token
    window = fed[-13:]  # the last token opened a block, so the oldest of the 4 window blocks left
    assert cache.seq.num_sink_blocks == sink_blocks
    assert cache.seq.token_ids == fed[:4 * sink_blocks] + window
    cache.manager.check([cache.seq])


def _cache_cfg(num_blocks):
    from streamchat.config import CacheConfig

    return CacheConfig(block_size=4, num_blocks=num_blocks)


def test_sinks_change_the_numbers(tiny, ids):
    """Once the window slides, `sink` and `window` see different caches, so different NLLs."""
    sink = streamed_policy(tiny, "sink", ids, SPEC).nll
    window = streamed_policy(tiny, "window", ids, SPEC).nll
    assert torch.equal(sink[:16], window[:16])  # 16 tokens fed: nothing evicted yet
    assert not torch.allclose(sink[24:], window[24:])


def test_h2o_keeps_sinks_and_recent_blocks_and_evicts_by_score(tiny, ids):
    """`h2o` holds the sink block, the most recent block, and among the rest the blocks it scored
    highest; it evicts a different block than `sink` once the window is full, so the NLLs part."""
    cache = policy_cache("h2o", len(ids), SPEC)
    runner = ModelRunner(tiny, _cache_cfg(cache.num_blocks))
    h2o = stream_nll(runner, cache.manager, cache.seq, ids, cache.chunk)
    seq, fed = cache.seq, ids[:-1]
    assert seq.eviction == "h2o" and seq.num_tokens == 4 + 13 and seq.token_ids[:4] == fed[:4]
    assert seq.token_ids[-1:] == fed[-1:] and seq.token_ids[-5:-1] == fed[-5:-1], "the recent block stays"
    assert seq.token_ids != fed[:4] + fed[-13:], "not what sink + window keeps"
    assert len(seq.block_scores) == 5 and all(x > 0 for x in seq.block_scores[:4])
    cache.manager.check([seq])
    sink = streamed_policy(tiny, "sink", ids, SPEC).nll
    assert torch.allclose(h2o[:20], sink[:20], atol=1e-5)  # nothing evicted yet: the same cache
    assert not torch.allclose(h2o[24:], sink[24:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_equals_full_when_the_window_holds_the_text(tiny_hf, ids, dtype):
    """A window larger than the text never evicts: `sink` is `full`, bit for bit."""
    loaded = _loaded(tiny_hf, dtype)
    spec = EvalSpec(sink_tokens=4, window_tokens=128, block_size=4)
    sink = streamed_policy(loaded, "sink", ids, spec)
    full = streamed_policy(loaded, "full", ids, spec, chunk=4)
    assert full.note is None
    assert torch.equal(sink.nll, full.nll)


def test_full_stops_at_the_models_context(tiny_hf):
    """`full` scores max_position_embeddings tokens and says where it stopped."""
    config = _tiny_config()
    config.max_position_embeddings = 40
    model = LlamaModel(config, tiny_hf.state_dict(), torch.float32, torch.device("cpu"), TorchBackend())
    loaded = LoadedModel(None, config, None, model)
    result = streamed_policy(loaded, "full", list(range(100)), SPEC)
    assert result.nll.shape == (40,)
    assert result.note == "stopped at the model's context of 40 tokens (max_position_embeddings)"


def test_recompute_equals_a_direct_forward_of_the_last_window(tiny_hf, tiny, ids):
    """The oracle's NLL at t is transformers' NLL of token t+1 given the W tokens ending at t."""
    result = recompute_policy(tiny, ids, SPEC)  # stride 1: every target
    assert torch.equal(result.targets, torch.arange(89))
    expected = []
    with torch.no_grad():
        for t in range(89):
            context = ids[max(0, t + 1 - 16):t + 1]
            logits = tiny_hf(torch.tensor([context])).logits[0, -1]
            expected.append(F.cross_entropy(logits[None], torch.tensor([ids[t + 1]])))
    torch.testing.assert_close(result.nll, torch.stack(expected), atol=1e-4, rtol=1e-5)


def test_recompute_sample_is_strided():
    """Targets stride-1, 2*stride-1, ...; stride 1 is every target."""
    assert recompute_targets(20, 6).tolist() == [5, 11, 17]
    assert recompute_targets(5, 1).tolist() == [0, 1, 2, 3]


def test_shipped_text():
    """Botchan ships unmodified: the checksum in its licence note, >= 200,000 characters, < 2 MB."""
    data = DEFAULT_TEXT.read_bytes()
    assert hashlib.sha256(data).hexdigest() == BOTCHAN_SHA256
    assert BOTCHAN_SHA256 in (DEFAULT_TEXT.parent / "LICENSE-botchan.md").read_text()
    assert len(data) < 2 << 20 and len(data.decode("utf-8-sig")) >= 200_000


@pytest.mark.slow
def test_cli_json_lines(capsys):
    """`streamchat eval --json`: one object per policy, in order, on the bundled model."""
    rc = cli.main(["eval", "--tokens", "96", "--window-tokens", "32", "--block-size", "16", "--h2o-recent-tokens", "0",
                   "--recompute-stride", "8", "--json", "--num-threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""  # no progress bar when stderr is not a terminal
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in rows] == ["full", "window", "sink", "h2o", "recompute"]
    common = {"policy", "weights", "kv_dtype", "sink_tokens", "window_tokens", "block_size", "tokens", "nll",
              "ppl", "seconds"}
    for r in rows:
        assert common <= set(r) and r["kv_dtype"] == "auto" and r["weights"] == "bf16" and r["block_size"] == 16
        assert r["ppl"] == pytest.approx(math.exp(r["nll"])) and r["seconds"] > 0
    full, window, sink, h2o, recompute = rows
    assert (h2o["sink_tokens"], h2o["window_tokens"], h2o["tokens"]) == (4, 32, 95)
    assert set(full) == common | {"sample_tokens", "sample_nll", "sample_ppl"}
    assert (full["sink_tokens"], full["window_tokens"], full["tokens"]) == (0, None, 95)
    assert (window["sink_tokens"], window["window_tokens"], window["tokens"]) == (0, 32, 95)
    assert (sink["sink_tokens"], sink["window_tokens"], sink["tokens"]) == (4, 32, 95)
    assert sink["sample_tokens"] == 11
    assert set(recompute) == common | {"stride", "note"}
    assert (recompute["stride"], recompute["tokens"], recompute["window_tokens"]) == (8, 11, 32)
    assert recompute["note"] == "strided sample: 1 token in 8"


@pytest.mark.parametrize("args,message", [
    (["/no/such/file.txt"], "text file not found: /no/such/file.txt"),
    (["EMPTY"], "text file is empty: EMPTY"),
    (["--window-tokens", "0"], "--window-tokens must be a positive integer, got 0"),
    (["--sink-tokens", "-4"], "--sink-tokens must be a positive integer, got -4"),
    (["--tokens", "0"], "--tokens must be a positive integer, got 0"),
    (["--tokens", "1"], "--tokens must be at least 2 (one to read, one to predict), got 1"),
    (["--recompute-stride", "0"], "--recompute-stride must be a positive integer, got 0"),
    (["--block-size", "12"], "--block-size must be a power of two, got 12"),
    (["--window-tokens", "16"], "--window-tokens (16) must hold at least two blocks of 16 tokens"),
    (["--policy", "sink,lru"], "--policy: unknown 'lru'; choose from full, window, sink, h2o, recompute"),
    (["--h2o-recent-tokens", "1000"], "--h2o-recent-tokens must be in [0, window_tokens - 2 * block_size] "
                                      "(= 992), got 1000"),
    (["--h2o-decay", "0"], "--h2o-decay must be in (0, 1], got 0.0"),
    (["--kv-dtype", "int9"], f"--kv-dtype: unknown 'int9'; choose from {', '.join(KV_DTYPES)}"),
    (["--weights", "int4,fp4"], f"--weights: unknown 'fp4'; choose from {', '.join(WEIGHTS)}"),
])
def test_bad_inputs_fail_in_one_line(tmp_path, capsys, args, message):
    """Each bad input exits 2 with one line naming the problem, before the model loads."""
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    assert cli.main(["eval", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"streamchat: error: {message.replace('EMPTY', str(empty))}\n"


def test_the_cli_side_imports_no_torch():
    """`streamchat chat` builds every parser, ours included: importing it must not pull in torch."""
    import subprocess
    import sys

    code = ("import sys, streamchat.evaluate as e, streamchat.cli as c; c.build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(','.join(e.POLICIES))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    from streamchat.evaluate_policies import POLICIES

    assert done.stdout.strip() == ",".join(POLICIES)
