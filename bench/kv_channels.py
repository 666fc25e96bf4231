"""Per-token vs per-channel scales for quantized keys, on the model's real keys as the pool stores them.

Runs 512 tokens of the shipped text through the bundled model (fp32), takes
every layer's keys as stored in the pool (rotated by their offset in their
block, 0..block_size-1: what a quantized pool quantizes), and prints the
relative error ||q(x) - x|| / ||x|| of symmetric int8 and int4 quantization
with one scale per token per head (what streamchat stores) and with one scale
per channel over the 512 tokens (what KIVI/KVQuant suggest for keys).

    python bench/kv_channels.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, ModelConfig
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.runner import ModelRunner, load_model

TEXT = Path(__file__).resolve().parents[1] / "streamchat" / "data" / "botchan.txt"


def rel_error(x: torch.Tensor, dim: int, qmax: int) -> float:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-8) / qmax
    q = (x / scale).round().clamp(-qmax, qmax) * scale
    return ((q - x).norm() / x.norm()).item()


def main() -> None:
    loaded = load_model(ModelConfig(dtype="float32"))
    ids = loaded.tokenizer(TEXT.read_text()[20000:24000])["input_ids"][:512]
    runner = ModelRunner(loaded, CacheConfig(num_blocks=40))
    mgr = KVCacheManager(BlockPool(40), 16, 4, 1 << 20)
    seq = mgr.new_seq()
    placed = mgr.append(seq, ids)
    runner.execute(StepBatch(prefill=[SeqChunk(ids, placed.positions, placed.slots, list(seq.block_ids), True)]))
    s = loaded.model.shape
    rows = {}
    for name, qmax in (("int8", 127), ("int4", 7)):
        per_token = per_channel = 0.0
        for kv in runner.kv_caches:
            k = kv.key.view(-1, s.num_kv_heads, s.head_dim)[placed.slots]  # (T, KVH, D)
            per_token += rel_error(k, -1, qmax) / s.num_layers
            per_channel += rel_error(k, 0, qmax) / s.num_layers
        rows[name] = (per_token, per_channel)
        print(f"{name}: key relative error per token {per_token:.4f}, per channel {per_channel:.4f}")
    print(json.dumps({"bench": "kv_channels", **{f"{k}_{w}": round(v[i], 5) for k, v in rows.items()
                                                 for i, w in enumerate(("per_token", "per_channel"))}}))


if __name__ == "__main__":
    main()
