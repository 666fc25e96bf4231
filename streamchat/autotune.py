"""Measuring the automatic choices once per model: `--weights auto` (and the KV storage the engine picks).

Owns running the model over a slice of the shipped text to compare weight
formats (perplexity, and decode step time interleaved across the formats);
the decision and its cache are `model.weights_auto`'s. It sits above the
model layer (it uses the evaluation's streamed policies), so the model layer
never imports it: callers hand `measure_weights` to `load_model`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from streamchat import evaluate_policies as ep
from streamchat.config import CacheConfig
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
