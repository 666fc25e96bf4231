"""Tests of the model fingerprint: the weights' bytes name the model, each file hashed once and cached."""

import json
import logging
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from streamchat.model import fingerprint as fp
from streamchat.model.loader import resolve
from streamchat.tiers import kvfile
from streamchat.tiers.kvfile import KVFileError, KVLayout, SeqState, Snapshot, expected_tensors

SID = "sess_" + "cd" * 16


def model_folder(path, seed: int):
    """A Llama-shaped folder whose one weight file has the same size and names for every seed."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    weights = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    save_file({"model.embed_tokens.weight": weights}, str(path / "model.safetensors"))
    return path


@pytest.fixture
def hashed(monkeypatch):
    """The files whose bytes were read to hash them, in order."""
    calls = []
    real = fp.hashlib.file_digest
    monkeypatch.setattr(fp.hashlib, "file_digest",
                        lambda f, make: calls.append(os.path.basename(f.name)) or real(f, make))
    return calls


def test_same_shape_other_weights_get_another_fingerprint_and_refuse_each_others_kv(tmp_path):
    """Two folders alike in names and sizes but not in weights differ; KV written under one is `foreign`
    under the other."""
    cache = str(tmp_path / "cache")
    a = resolve(str(model_folder(tmp_path / "base", 1)), cache)
    b = resolve(str(model_folder(tmp_path / "tuned", 2)), cache)
    assert (a.folder / "model.safetensors").stat().st_size == (b.folder / "model.safetensors").stat().st_size
    assert a.fingerprint != b.fingerprint and len(a.fingerprint) == 32
    assert resolve(str(a.folder), cache).fingerprint == a.fingerprint
    layout_a, layout_b = kv_layout(a.fingerprint), kv_layout(b.fingerprint)
    path = tmp_path / (SID + ".safetensors")
    kvfile.write_atomic(path, tiny_snapshot(layout_a), layout_a)
    assert kvfile.read(path, layout_a, SID, vocab_size=100).state.token_ids == list(range(5))
    with pytest.raises(KVFileError) as err:
        kvfile.read(path, layout_b, SID, vocab_size=100)
    assert err.value.reason == "foreign" and str(err.value).startswith(
        f"foreign: 'model_fingerprint' is '{a.fingerprint}' in the file, '{b.fingerprint}' here")


def test_a_digest_is_cached_privately_and_reused_until_the_file_changes(tmp_path, hashed):
    """The second start reads no weights; the cache is 0700/0600; a rewrite that keeps size and mtime
    (as `cp -p` would) is hashed again."""
    folder, cache = model_folder(tmp_path / "m", 1), tmp_path / "cache"
    first = resolve(str(folder), str(cache)).fingerprint
    assert hashed == ["model.safetensors"]
    assert resolve(str(folder), str(cache)).fingerprint == first and hashed == ["model.safetensors"]
    [entry] = (cache / "fingerprints").iterdir()
    assert stat.S_IMODE((cache / "fingerprints").stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    weights = folder / "model.safetensors"
    before = weights.stat()
    other = model_folder(tmp_path / "other", 2) / "model.safetensors"
    os.replace(other, weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert resolve(str(folder), str(cache)).fingerprint != first and len(hashed) == 2


def test_a_cache_entry_others_may_write_is_not_believed(tmp_path, hashed, caplog):
    """An entry anyone else could have edited is ignored (with a warning) and the file hashed again."""
    folder, cache = model_folder(tmp_path / "m", 1), tmp_path / "cache"
    first = resolve(str(folder), str(cache)).fingerprint
    [entry] = (cache / "fingerprints").iterdir()
    doc = json.loads(entry.read_text())
    entry.write_text(json.dumps({**doc, "blake2b": "00" * fp.DIGEST_BYTES}))  # a forged digest ...
    os.chmod(entry, 0o666)  # ... in an entry others may write
    with caplog.at_level(logging.WARNING, logger="streamchat.model.fingerprint"):
        assert resolve(str(folder), str(cache)).fingerprint == first
    assert len(hashed) == 2 and f"ignoring the cached weights digest {entry}: {entry} may be written by others" \
        in caplog.text
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600  # rewritten privately


def kv_layout(fingerprint: str) -> KVLayout:
    import torch

    from streamchat.model.kv_spec import FullAttentionSpec

    return KVLayout(fingerprint, "torch.float32", "auto", 4, 4, 16, True,
                    kv_specs=(FullAttentionSpec(4, 1, 8, torch.float32, "auto"),))


def tiny_snapshot(layout: KVLayout) -> Snapshot:
    state = SeqState(token_ids=list(range(5)), num_sink_blocks=1, pinned_tokens=0, pristine=True, total_tokens=5)
    tensors = {name: torch.zeros(2, *tail, dtype=dtype) for name, (dtype, tail) in expected_tensors(layout).items()}
    return Snapshot(SID, state, tensors, None)
