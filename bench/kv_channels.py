"""Per-token vs per-channel scales for quantized keys, on the model's real keys as the pool stores them.

Runs 512 tokens of the shipped text through the bundled model (fp32), takes
every layer's keys as stored in the pool (rotated by their offset in their
block, 0..block_size-1: what a quantized pool quantizes), and prints the
relative error ||q(x) - x|| / ||x|| of symmetric int8 and int4 quantization
with one scale per token per head (what streamchat stores) and with one scale
per channel over the 512 tokens (what KIVI/KVQuant suggest for keys).

Then int4 keys as the pool can store them, one (scale, min) per channel per
block of 16 (the block's grid depends on tokens that arrive one per decode step):

    once        each block quantized once, whole (a prefill of whole blocks; the ideal)
    requantize  written token by token, the block re-quantized on every write (what
                `reference.requantize_blocks` does)
    symmetric   once, with a symmetric grid per channel per block (max|x| / 7, no
                minimum: the format before the (scale, min) pairs)
    first       symmetric, written token by token under the scale of the block's
                first token times a guard of 2, later tokens clipped
    per token   the values' format: a (scale, min) per token per group of 32 channels

    python bench/kv_channels.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, ModelConfig
from streamchat.kernels import quant, reference
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
    blocks = block_errors(runner, placed.slots, s.num_kv_heads, s.head_dim)
    for name, err in blocks.items():
        print(f"int4 keys, {name}: relative error {err:.4f}")
    print(json.dumps({"bench": "kv_channels", **{f"{k}_{w}": round(v[i], 5) for k, v in rows.items()
                                                 for i, w in enumerate(("per_token", "per_channel"))},
                      **{f"int4_block_{k.replace(' ', '_')}": round(v, 5) for k, v in blocks.items()}}))


def block_errors(runner, slots, num_kv_heads: int, head_dim: int, bs: int = 16) -> dict[str, float]:
    """Relative error of int4 keys per channel per block: once, re-quantized per write, first-write scale."""
    out = dict.fromkeys(("once", "requantize", "symmetric", "first", "per token"), 0.0)
    num_layers = len(runner.kv_caches)
    for kv in runner.kv_caches:
        k = kv.key.view(-1, num_kv_heads, head_dim)[slots].float()  # (T, KVH, D), as stored
        nb = k.shape[0] // bs
        k = k[:nb * bs]
        x = k.view(nb, bs, num_kv_heads, head_dim)
        q, sc = quant.quantize_channels(x, torch.ones(nb, bs, dtype=torch.bool))
        once = quant.dequantize_channels(q, sc, torch.float32)
        pool = torch.zeros(nb, bs, num_kv_heads, head_dim // 2, dtype=torch.uint8)
        scale = torch.ones(nb, num_kv_heads, head_dim, 2, dtype=torch.float16)
        for o in range(bs):  # every block gets its o-th token, as a decode step would write it
            reference.requantize_blocks(pool, scale, x[:, o], torch.arange(nb) * bs + o)
        requant = quant.dequantize_channels(pool, scale, torch.float32)
        amax = (x.abs().amax(dim=1, keepdim=True) / 7).clamp_min(1e-8)
        symmetric = (x / amax).round().clamp(-7, 7) * amax
        first = (x[:, :1].abs() * 2 / 7).clamp_min(1e-8)
        clipped = (x / first).round().clamp(-7, 7) * first
        tq, ts = quant.quantize(k, torch.uint8)
        per_token = quant.dequantize(tq, ts, torch.float32)
        for name, y in (("once", once.reshape_as(k)), ("requantize", requant.reshape_as(k)),
                        ("symmetric", symmetric.reshape_as(k)), ("first", clipped.reshape_as(k)),
                        ("per token", per_token)):
            out[name] += ((y - k).norm() / k.norm()).item() / num_layers
    return out


if __name__ == "__main__":
    main()
