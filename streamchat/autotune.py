"""Measuring the automatic choices once per model: `--weights auto` and `--kv-dtype auto`.

Owns running the model over a slice of the shipped text to compare weight
formats and KV storages (perplexity, and decode step time interleaved
across them); the decisions and their caches are `model.weights_auto`'s
and `model.kv_auto`'s. It sits above the
model layer (it uses the evaluation's streamed policies), so the model layer
never imports it: callers hand `measure_weights` to `load_model`.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from streamchat import evaluate_policies as ep
from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, ConfigError
from streamchat.model import kv_auto
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.loader import default_cache_dir
from streamchat.model.runner import ModelRunner
from streamchat.model.weights import FORMATS
from streamchat.model.weights_auto import AUTO_TOKENS, DECODE_STEPS, Measured
from streamchat.text.corpus import read_text, tokenize


def measure_weights(build: Callable[[str], object], tokenizer) -> dict[str, Measured]:
    """Every weight format measured on the first AUTO_TOKENS tokens of the shipped text."""
    return _measure(build, tokenize(tokenizer, read_text(None), AUTO_TOKENS))


def _measure(build: Callable[[str], object], token_ids: list[int]) -> dict[str, Measured]:
    """Each format's perplexity over `token_ids` and its decode step time; `build(fmt)` -> LoadedModel.

    All formats are held at once (their steps interleave): dense plus about
    half its bytes again, the quantized copies sharing the dense embedding.
    """
    loaded = {fmt: build(fmt) for fmt in FORMATS}
    spec = ep.EvalSpec()
    ppl = {fmt: float(ep.streamed_policy(m, "full", token_ids, spec).nll.double().mean().exp())
           for fmt, m in loaded.items()}
    ms = decode_ms(loaded, token_ids, spec)
    return {fmt: Measured(ppl[fmt], ms[fmt]) for fmt in FORMATS}


def decode_ms(loaded: dict[str, object], token_ids: list[int], spec) -> dict[str, float]:
    """Median single-token step of each model, the models taking turns step by step."""
    steps = DECODE_STEPS + 2
    caches = {fmt: ep.policy_cache("full", steps + 1, spec) for fmt in loaded}
    runners = {fmt: ModelRunner(m, CacheConfig(block_size=spec.block_size, num_blocks=caches[fmt].num_blocks,
                                               prefix_sharing=False))
               for fmt, m in loaded.items()}
    times: dict[str, list[float]] = {fmt: [] for fmt in loaded}
    for step in range(steps):
        for fmt, runner in runners.items():
            c = caches[fmt]
            started = time.perf_counter()
            ep.stream_nll(runner, c.manager, c.seq, token_ids[step:step + 2], 1)  # one token fed
            times[fmt].append(time.perf_counter() - started)
    return {fmt: 1e3 * statistics.median(t[2:]) for fmt, t in times.items()}


# -- --kv-dtype auto ---------------------------------------------------------------

KV_TOKENS = 1024  # perplexity slice: long enough that most scores read cached (quantized) keys
LONGCHAT_SESSIONS, LONGCHAT_TOKENS = 4, 2048  # the step workload: sessions with a full default window


def resolve_kv_dtype(loaded, cache: CacheConfig, cache_dir: str | None = None) -> tuple[CacheConfig, str]:
    """`cache` with auto resolved (measured once per served model, device, dtype and attention backend,
    then cached), and why: what /healthz and the start-up log say."""
    if cache.kv_dtype != "auto":
        return cache, f"as configured (--kv-dtype {cache.kv_dtype})"
    model = loaded.model
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = kv_auto.decision_path(folder, loaded.source.fingerprint, model.device.type,
                                 str(model.dtype).removeprefix("torch."), model.backend.name)
    choice = kv_auto.choose(path, lambda: measure_kv_dtypes(loaded, cache))
    return dataclasses.replace(cache, kv_dtype=choice.kv_dtype), choice.reason


def measure_kv_dtypes(loaded, cache: CacheConfig) -> dict[str, kv_auto.KvMeasured]:
    """Each storage the backend takes: perplexity over the first KV_TOKENS tokens of the shipped text, and
    for float and those within the perplexity bound, the fastest decode step of LONGCHAT_SESSIONS sessions
    of LONGCHAT_TOKENS cached tokens, the storages taking turns step by step. The fastest, not the median:
    a decision is made once and cached, and a start that shares the machine (a test run beside it, a
    build) had made medians of int8 +31% and +47% against float where a quiet start measured -4.7%."""
    token_ids = tokenize(loaded.tokenizer, read_text(None), KV_TOKENS)
    ppl, sizes = {}, {}
    for name in kv_auto.CANDIDATES:
        try:
            runner = ModelRunner(loaded, dataclasses.replace(cache, kv_dtype=name, num_blocks=2))
        except ConfigError:  # e.g. int4 on the triton backend, or a head_dim it does not take
            continue
        sizes[name] = runner.bytes_per_token
        ppl[name] = float(ep.streamed_policy(loaded, "full", token_ids, ep.EvalSpec(kv_dtype=name))
                          .nll.double().mean().exp())
    timed = [name for name in ppl if name == "float" or ppl[name] <= ppl["float"] * (1 + kv_auto.PPL_TOLERANCE)]
    chats = {name: _LongChat(loaded, dataclasses.replace(cache, kv_dtype=name)) for name in timed}
    times: dict[str, list[float]] = {name: [] for name in chats}
    for _ in range(DECODE_STEPS + 2):
        for name, chat in chats.items():
            times[name].append(chat.step())
    return {name: kv_auto.KvMeasured(ppl[name], 1e3 * min(times[name][2:]) if name in times else None,
                                     sizes[name]) for name in ppl}


class _LongChat:
    """LONGCHAT_SESSIONS sequences with LONGCHAT_TOKENS cached tokens each (random contents: what they hold
    does not change the cost), stepped one token at a time."""

    def __init__(self, loaded, cache: CacheConfig) -> None:
        tokens = LONGCHAT_TOKENS + DECODE_STEPS + 2
        num_blocks = LONGCHAT_SESSIONS * -(-tokens // cache.block_size) + 2
        self.runner = ModelRunner(loaded, dataclasses.replace(cache, num_blocks=num_blocks, prefix_sharing=False))
        self.rng = random.Random(0)
        self.manager = KVCacheManager(BlockPool(num_blocks), cache.block_size, cache.block_size,
                                      num_blocks * cache.block_size, prefix_sharing=False)
        self.seqs = [self.manager.new_seq() for _ in range(LONGCHAT_SESSIONS)]
        for seq in self.seqs:
            for start in range(0, LONGCHAT_TOKENS, self.manager.max_chunk):
                self.manager.append(seq, self._ids(min(self.manager.max_chunk, LONGCHAT_TOKENS - start)))
        gen = torch.Generator().manual_seed(0)
        for kv in self.runner.kv_caches:
            for t in (kv.key, kv.value):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.runner.model.shape.vocab_size) for _ in range(n)]

    def step(self) -> float:
        chunks = []
        for seq in self.seqs:
            ids = self._ids(1)
            placed = self.manager.append(seq, ids)
            chunks.append(SeqChunk(ids, placed.positions, placed.slots, list(seq.block_ids), True))
        started = time.perf_counter()
        self.runner.execute(StepBatch(decode=chunks))
        return time.perf_counter() - started
