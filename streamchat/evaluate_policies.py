"""Per-token NLL of a token stream under each cache policy, driving the model runner directly.

Owns how each policy feeds the model; `streamchat.evaluate` owns the text,
the command line and the report. Every token is predicted with the cache as
the policy leaves it at that point, as StreamingLLM's evaluation does:

    full       no eviction; stops at the model's context (max_position_embeddings)
    window     the most recent tokens only: a sliding window with no sink region
    sink       sink region + window: the engine's own KVCacheManager, unchanged
    h2o        the same sink region and window budget, the engine's h2o eviction:
               the block with the least accumulated attention mass outside the
               sinks and the protected recent blocks leaves (scores from every
               forward's attention, as the engine feeds them)
    recompute  the oracle: the last `window_tokens` tokens recomputed from
               scratch at positions 0..W-1 for each predicted token (a sample)

Target index t means "token t+1 predicted from tokens <= t".

Feeding one block per forward is exact (see `stream_nll`): the manager evicts
only when a token needs a new block, i.e. at block starts, and within a chunk
causal attention gives each row the logits it would have had fed alone.

    tokens:   | block k (fed in one forward)  | block k+1 ...
    eviction: ^ only here, before block k's first token is placed
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import H2O, KVCacheManager, SeqCache
from streamchat.config import CacheConfig
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.runner import LoadedModel, ModelRunner

POLICIES = ("full", "window", "sink", "h2o", "recompute")
FULL_CHUNK_BLOCKS = 16  # `full` never evicts, so any chunk is exact: bigger is faster


@dataclass(frozen=True)
class EvalSpec:
    """What one evaluation measures; `kv_dtype` is the pool's storage format."""

    sink_tokens: int = 4
    window_tokens: int = 1024
    block_size: int = 16
    recompute_stride: int = 61  # odd: the sample visits every offset within a block
    kv_dtype: str = "auto"
    h2o_recent_tokens: int = 256
    h2o_decay: float = 1.0


class PolicyNLL(NamedTuple):
    """NLL (float32) of the targets a policy scored, and why it stopped early, if it did."""

    targets: torch.Tensor  # (N,) int64 target indices t
    nll: torch.Tensor  # (N,) float32
    seconds: float
    note: str | None = None


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass


def _runner(loaded: LoadedModel, spec: EvalSpec, num_blocks: int) -> ModelRunner:
    cache = CacheConfig(block_size=spec.block_size, num_blocks=num_blocks, sink_tokens=spec.sink_tokens,
                        window_tokens=spec.window_tokens, kv_dtype=spec.kv_dtype, prefix_sharing=False)
    return ModelRunner(loaded, cache)


def _forward(runner: ModelRunner, chunk: SeqChunk, decode: bool, rows: torch.Tensor,
             block_mass: torch.Tensor | None = None) -> torch.Tensor:
    batch = StepBatch(decode=[chunk]) if decode else StepBatch(prefill=[chunk])
    ids, positions, meta, _ = runner.prepare(batch)
    return runner.model.forward(ids, positions, meta, runner.kv_caches, rows, block_mass)


@torch.inference_mode()
def stream_nll(runner: ModelRunner, manager: KVCacheManager, seq: SeqCache, token_ids: list[int],
               chunk: int, bar=None) -> torch.Tensor:
    """NLL (float32) of token_ids[1:], feeding `chunk` tokens per forward (1: the decode path).

    The last token is only predicted, never fed. `chunk` must be one block
    (or 1) when the manager evicts, or a chunk's first rows would see a cache
    evicted for its later rows.
    """
    bar = bar or _NullBar()
    dev = runner.model.device
    targets = torch.tensor(token_ids[1:], dtype=torch.int64, device=dev)
    out = []
    for start in range(0, len(token_ids) - 1, chunk):
        piece = token_ids[start:min(start + chunk, len(token_ids) - 1)]
        placed = manager.append(seq, piece)
        c = SeqChunk(piece, placed.positions, placed.slots, list(seq.block_ids), True)
        rows = torch.arange(len(piece), device=dev)
        if seq.eviction == "h2o":  # the scores, fed as the engine feeds them (ModelRunner.execute_with_mass)
            mass = torch.zeros(1, len(seq.block_ids), device=dev)
            logits = _forward(runner, c, chunk == 1, rows, mass)
            shape = runner.model.shape
            manager.observe(seq, mass[0].div_(shape.num_heads * shape.num_layers).tolist(), len(piece))
        else:
            logits = _forward(runner, c, chunk == 1, rows)  # (n, vocab)
        out.append(F.cross_entropy(logits, targets[start:start + len(piece)], reduction="none"))
        bar.update(len(piece))
    return torch.cat(out).float().cpu()


class PolicyCache(NamedTuple):
    """A streamed policy's cache: the manager, the sequence, the pool size and the feeding."""

    manager: KVCacheManager
    seq: SeqCache
    num_blocks: int
    chunk: int


def policy_cache(policy: str, num_tokens: int, spec: EvalSpec) -> PolicyCache:
    """The cache `full`, `window`, `sink` or `h2o` streams `num_tokens` tokens through."""
    bs = spec.block_size
    if policy == "full":
        num_blocks = -(-num_tokens // bs) + 2
        manager = KVCacheManager(BlockPool(num_blocks), bs, bs, num_blocks * bs, prefix_sharing=False)
        return PolicyCache(manager, manager.new_seq(), num_blocks, bs * FULL_CHUNK_BLOCKS)
    if policy not in ("window", "sink", "h2o"):
        raise ValueError(f"not a streamed policy: {policy!r}")
    sink_tokens = spec.sink_tokens if policy != "window" else 0
    num_blocks = -(-sink_tokens // bs) + -(-spec.window_tokens // bs) + 2
    eviction = "h2o" if policy == "h2o" else "sink_window"
    manager = KVCacheManager(BlockPool(num_blocks), bs, sink_tokens, spec.window_tokens, prefix_sharing=False,
                             eviction=eviction, h2o=H2O(spec.h2o_recent_tokens, spec.h2o_decay))
    # `sink` and `h2o` are exactly what the engine builds; `window` needs a sink region of
    # zero blocks, which new_seq (it rounds up to at least one block) never gives
    seq = manager.new_seq() if policy != "window" else SeqCache(num_sink_blocks=0)
    return PolicyCache(manager, seq, num_blocks, bs)


def streamed_policy(loaded: LoadedModel, policy: str, token_ids: list[int], spec: EvalSpec,
                    bar=None, chunk: int | None = None) -> PolicyNLL:
    """`full`, `window`, `sink` or `h2o` over the whole stream (`full`: up to the model's context).

    `chunk` overrides the feeding (tests use it); by default one block for the
    evicting policies and FULL_CHUNK_BLOCKS blocks for `full`, which never evicts.
    """
    note = None
    max_pos = loaded.model.shape.max_position_embeddings
    if policy == "full" and len(token_ids) > max_pos + 1:
        note = f"stopped at the model's context of {max_pos} tokens (max_position_embeddings)"
        token_ids = token_ids[:max_pos + 1]
    cache = policy_cache(policy, len(token_ids), spec)
    started = time.perf_counter()
    nll = stream_nll(_runner(loaded, spec, cache.num_blocks), cache.manager, cache.seq, token_ids,
                     chunk or cache.chunk, bar)
    assert policy != "full" or cache.seq.evicted_tokens == 0, "full must never evict"
    return PolicyNLL(torch.arange(len(nll)), nll, time.perf_counter() - started, note)


def recompute_targets(num_tokens: int, stride: int) -> torch.Tensor:
    """The strided sample of target indices the oracle scores: stride-1, 2*stride-1, ..."""
    return torch.arange(stride - 1, num_tokens - 1, stride)


@torch.inference_mode()
def recompute_policy(loaded: LoadedModel, token_ids: list[int], spec: EvalSpec, bar=None,
                     targets: torch.Tensor | None = None) -> PolicyNLL:
    """The oracle: each target t is predicted from token_ids[t+1-W : t+1] at positions 0..W-1."""
    bar = bar or _NullBar()
    bs, window = spec.block_size, spec.window_tokens
    if targets is None:
        targets = recompute_targets(len(token_ids), spec.recompute_stride)
    num_blocks = -(-window // bs) + 2
    runner = _runner(loaded, spec, num_blocks)
    manager = KVCacheManager(BlockPool(num_blocks), bs, bs, num_blocks * bs, prefix_sharing=False)
    dev = runner.model.device
    started = time.perf_counter()
    nll = []
    for t in targets.tolist():
        context = token_ids[max(0, t + 1 - window):t + 1]
        seq = manager.new_seq()
        placed = manager.append(seq, context)
        c = SeqChunk(context, placed.positions, placed.slots, list(seq.block_ids), True)
        logits = _forward(runner, c, False, torch.tensor([len(context) - 1], device=dev))  # (1, vocab)
        nll.append(F.cross_entropy(logits, torch.tensor([token_ids[t + 1]], device=dev), reduction="none"))
        manager.free(seq)
        bar.update(1)
    note = f"strided sample: 1 token in {spec.recompute_stride}" if spec.recompute_stride > 1 else None
    nll_t = torch.cat(nll).float().cpu() if nll else torch.zeros(0)
    return PolicyNLL(targets, nll_t, time.perf_counter() - started, note)


def run_policy(loaded: LoadedModel, policy: str, token_ids: list[int], spec: EvalSpec, bar=None) -> PolicyNLL:
    if policy == "recompute":
        return recompute_policy(loaded, token_ids, spec, bar)
    return streamed_policy(loaded, policy, token_ids, spec, bar)


def work_units(loaded: LoadedModel, policy: str, num_tokens: int, spec: EvalSpec) -> int:
    """What the progress bar counts for a policy: tokens fed, or oracle forwards."""
    if policy == "recompute":
        return len(recompute_targets(num_tokens, spec.recompute_stride))
    if policy == "full":
        return min(num_tokens - 1, loaded.model.shape.max_position_embeddings)
    return num_tokens - 1
