"""Decode latency and KV bytes of one long session: our bounded cache against transformers' unbounded one.

    python bench/long_context.py                          # 1k, 4k, 16k, 64k tokens of history
    python bench/long_context.py --sizes 1024,4096        # a quick smoke run
    python bench/long_context.py --num-threads 1          # on a machine shared with other work

1. streamchat: sessions through `LLM(...).engine`, exactly as the daemon
   runs them (sink + window, defaults from CacheConfig). By default one
   session per size, each fed to its size through `append_text` +
   `llm.drain()` (prefill in chunks of the scheduler's per-step budget, set
   here to the largest chunk the window allows); then `--rounds` rounds in
   which each session decodes its share of --decode-tokens greedily (the
   order reversed every other round), timed step by step (the engine's own
   inter-token gaps), so every size is timed in the same minutes.
   `--rounds 1` is the older way: one session grows through the sizes and is
   timed once at each, minutes apart (on a host whose speed drifts, that
   compares one minute with another). `session_stats().kv_bytes` is read.
2. transformers: the same weights and dtype with its default DynamicCache
   (unbounded), history fed in chunks, then greedy decode timed per token.
   It stops at the first size beyond the model's context
   (max_position_embeddings) or the memory this machine has, and says so.

History is the shipped Botchan (Project Gutenberg #8868), repeated if a size
needs more. Prints a table, then one JSON line: latency at the largest size
over latency at the smallest (target <= 1.15) and whether our KV bytes stay
flat once the window is full. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

TARGET_RATIO = 1.15
FEED_TOKENS = 16384  # history appended per call


@dataclass
class Row:
    engine: str
    size: int  # requested tokens of history
    history_tokens: int | None = None  # actual tokens in the session when the reply started
    kv_bytes: int | None = None
    decode_ms: float | None = None  # median per-token decode latency
    decode_p90_ms: float | None = None
    decode_cpu_ms: float | None = None  # median CPU time per token: steadier on a shared machine
    feed_seconds: float | None = None  # feeding the history up to this size (from the previous size)
    feed_tokens: int | None = None
    note: str = ""


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"--sizes: not a comma-separated list of integers: {text!r}") from None
    if not sizes or sizes[0] <= 0:
        raise SystemExit("--sizes: give positive token counts, e.g. 1024,4096")
    return sizes


def history_ids(tokenizer, num_tokens: int) -> list[int]:
    from streamchat.evaluate import DEFAULT_TEXT

    ids = tokenizer(DEFAULT_TEXT.read_text(encoding="utf-8-sig"), add_special_tokens=False,
                    verbose=False)["input_ids"]
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def _ms(samples: list[tuple[float, float]]) -> tuple[float | None, float | None, float | None]:
    """Median and p90 wall milliseconds, and median CPU milliseconds, of (wall, cpu) samples."""
    if not samples:
        return None, None, None
    wall = sorted(w for w, _ in samples)
    cpu = statistics.median(c for _, c in samples)
    return 1000 * statistics.median(wall), 1000 * wall[int(0.9 * (len(wall) - 1))], 1000 * cpu


# -- streamchat ---------------------------------------------------------------

def bench_ours(config, loaded, sizes: list[int], decode_tokens: int, rounds: int = 1) -> list[Row]:
    """rounds 1: one session grows through the sizes, a reply timed at each. rounds > 1: one session
    per size, each fed to its size, then `rounds` rounds in which every session decodes its share of
    `decode_tokens` (the order reversed every other round), so that all sizes are timed in the same
    minutes: on a host whose speed drifts, the sequential way compares one minute with another."""
    from streamchat.llm import LLM
    from streamchat.model.sampling import SamplingParams

    llm = LLM(config, loaded)
    engine = llm.engine
    ids = history_ids(loaded.tokenizer, sizes[-1])
    names = ["bench"] if rounds <= 1 else [f"bench-{size}" for size in sizes]
    for name in names:
        engine.open_session(name)
    fed = dict.fromkeys(names, 0)
    rows: list[Row] = []
    timed: dict[int, list] = {}
    for size in sizes:
        name = names[0] if rounds <= 1 else f"bench-{size}"
        have = engine.session_stats(name).total_tokens
        piece = ids[fed[name]:fed[name] + max(0, size - have)]
        fed[name] += len(piece)
        started = time.perf_counter()
        for at in range(0, len(piece), FEED_TOKENS):  # under the per-session pending limit (65,536)
            engine.append_text(name, loaded.tokenizer.decode(piece[at:at + FEED_TOKENS]))
            llm.drain()
        feed_s = time.perf_counter() - started
        history = engine.session_stats(name).total_tokens
        samples = _decode(llm, decode_tokens, SamplingParams(), name) if rounds <= 1 else []
        timed[size] = samples
        stats = engine.session_stats(name)
        rows.append(Row("streamchat", size, history, stats.kv_bytes, *_ms(samples), feed_s,
                        history - have, f"cache holds {stats.context_tokens} tokens"))
        if rounds <= 1:
            print(_format(rows[-1]), file=sys.stderr, flush=True)
    if rounds > 1:
        share = max(1, decode_tokens // rounds)
        for r in range(rounds):
            for size in (sizes if r % 2 == 0 else sizes[::-1]):
                timed[size] += _decode(llm, share, SamplingParams(), f"bench-{size}")
        for row in rows:
            row.decode_ms, row.decode_p90_ms, row.decode_cpu_ms = _ms(timed[row.size])
            row.note += f"; timed in {rounds} interleaved rounds"
            print(_format(row), file=sys.stderr, flush=True)
    for name in names:
        engine.close_session(name)
    return rows


def _decode(llm, decode_tokens: int, params, session: str = "bench",
            max_replies: int = 4) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each decode step of greedy replies in the session.

    A decode step is one whose batch fed a sampled token back (the engine's
    decode counter moved); it includes sampling and detokenizing. A reply
    that ends early (end of turn) is followed by another, up to `max_replies`;
    every reply and its end-of-turn marker join the history.
    """
    from streamchat.engine.events import ResponseFinished

    engine, samples = llm.engine, []
    for _ in range(max_replies):
        rid = f"bench-{time.monotonic_ns()}"
        engine.start_response(session, rid, params, decode_tokens - len(samples) + 1)
        finished = False
        while not finished:
            if not engine.has_work():
                raise RuntimeError("the engine went idle before the reply finished")
            decoded, wall, cpu = engine.metrics.decode_tokens, time.perf_counter(), time.process_time()
            events = engine.step()
            if engine.metrics.decode_tokens > decoded:
                samples.append((time.perf_counter() - wall, time.process_time() - cpu))
            finished = any(isinstance(e, ResponseFinished) and e.response_id == rid for e in events)
        llm.drain()
        if len(samples) >= decode_tokens:
            break
    return samples


# -- transformers -------------------------------------------------------------

def bench_transformers(loaded, sizes: list[int], decode_tokens: int, chunk: int) -> list[Row]:
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(loaded.source.folder, dtype=loaded.model.dtype).eval()
    max_pos = model.config.max_position_embeddings
    shape, elem = loaded.model.shape, torch.tensor([], dtype=loaded.model.dtype).element_size()
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * elem
    free = _available_bytes()
    ids = history_ids(loaded.tokenizer, sizes[-1])
    cache, fed, rows, logits = DynamicCache(config=model.config), 0, [], None
    for size in sizes:
        if size + decode_tokens > max_pos:
            rows.append(Row("transformers", size, note=f"stopped: exceeds the model's context ({max_pos})"))
            break
        if free is not None and (size + decode_tokens) * per_token > free // 2:
            rows.append(Row("transformers", size, note="stopped: its KV cache would not fit in memory"))
            break
        have = cache.get_seq_length()
        piece = ids[fed:fed + max(0, size - have)]
        fed += len(piece)
        started = time.perf_counter()
        with torch.inference_mode():
            for start in range(0, len(piece), chunk):
                out = model(torch.tensor([piece[start:start + chunk]]), past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1]
        feed_s = time.perf_counter() - started
        history = cache.get_seq_length()
        # the decoded tokens stay in the cache, as a reply stays in a session's history
        samples, logits = _hf_decode(model, cache, logits, decode_tokens)
        rows.append(Row("transformers", size, history, _cache_bytes(cache), *_ms(samples), feed_s, len(piece),
                        "unbounded DynamicCache"))
        print(_format(rows[-1]), file=sys.stderr, flush=True)
    return rows


@torch.inference_mode()
def _hf_decode(model, cache, logits, decode_tokens: int):
    samples = []
    for _ in range(decode_tokens):
        wall, cpu = time.perf_counter(), time.process_time()
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
        samples.append((time.perf_counter() - wall, time.process_time() - cpu))
    return samples, logits


def _cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- report -------------------------------------------------------------------

HEADER = (f"{'engine':<13} {'size':>6} {'history':>7} {'kv_MiB':>8} {'decode_ms':>9} {'p90_ms':>7} "
          f"{'cpu_ms':>7} {'feed_s':>7} {'feed_tok/s':>10}  note")


def _format(r: Row) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    rate = r.feed_tokens / r.feed_seconds if r.feed_seconds and r.feed_tokens else None
    kv = None if r.kv_bytes is None else r.kv_bytes / (1 << 20)
    return (f"{r.engine:<13} {r.size:>6} {num(r.history_tokens, 'd'):>7} {num(kv, '.2f'):>8} "
            f"{num(r.decode_ms, '.2f'):>9} {num(r.decode_p90_ms, '.2f'):>7} {num(r.decode_cpu_ms, '.2f'):>7} "
            f"{num(r.feed_seconds, '.1f'):>7} {num(rate, '.0f'):>10}  {r.note}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summary(ours: list[Row], cache_cfg) -> dict:
    """Latency at the largest size over the smallest (wall and CPU), and whether KV stays flat."""
    first, last = ours[0], ours[-1]
    full_at = cache_cfg.num_sink_blocks * cache_cfg.block_size + cache_cfg.window_tokens
    full = [r for r in ours if r.history_tokens and r.history_tokens > full_at]
    wall, cpu = _ratio(last.decode_ms, first.decode_ms), _ratio(last.decode_cpu_ms, first.decode_cpu_ms)
    return {
        "latency_ratio": wall,
        "cpu_ratio": cpu,
        "ratio_sizes": [first.size, last.size],
        "target": TARGET_RATIO,
        "meets_target": None if wall is None else wall <= TARGET_RATIO,
        "meets_target_cpu": None if cpu is None else cpu <= TARGET_RATIO,
        # from the first size whose window was already full: the bounded cost itself
        "latency_ratio_window_full": _ratio(last.decode_ms, full[0].decode_ms) if len(full) >= 2 else None,
        "cpu_ratio_window_full": _ratio(last.decode_cpu_ms, full[0].decode_cpu_ms) if len(full) >= 2 else None,
        "window_full_sizes": [r.size for r in full],
        "kv_flat_after_window": len({r.kv_bytes for r in full}) == 1 if len(full) >= 2 else None,
        "window_full_at_tokens": full_at,
    }


def main(argv: list[str] | None = None) -> int:
    from streamchat import settings
    from streamchat.config import CacheConfig, ConfigError, SchedulerConfig
    from streamchat.model.runner import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096,16384,65536", help="tokens of history, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed at each size")
    p.add_argument("--rounds", type=int, default=4,
                   help="one session per size, timed in this many interleaved rounds (1: one session "
                        "growing through the sizes, each timed once, as before)")
    p.add_argument("--sink-tokens", type=int, default=CacheConfig.sink_tokens)
    p.add_argument("--window-tokens", type=int, default=CacheConfig.window_tokens)
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--hf-chunk", type=int, default=512, help="transformers: history tokens per forward")
    p.add_argument("--skip-transformers", action="store_true")
    settings.add_flags(p, ("model",))
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    try:
        cfg = settings.load(args)
        cache = CacheConfig(block_size=args.block_size, sink_tokens=args.sink_tokens,
                            window_tokens=args.window_tokens, prefix_sharing=False)
        # room for one session plus one whole chunk: KVCacheManager.can_append does not
        # credit the blocks an append's own eviction frees, so a pool of exactly
        # max_blocks_per_session() stalls once the window is full
        sessions = len(sizes) if args.rounds > 1 else 1
        cache = dataclasses.replace(
            cache, num_blocks=sessions * (cache.max_blocks_per_session() + cache.num_window_blocks + 2))
        window_cap = cache.num_window_blocks * cache.block_size
        cfg = cfg.replace(cache=cache, scheduler=SchedulerConfig(max_tokens_per_step=window_cap - cache.block_size))
        cfg.validate()
    except ConfigError as exc:
        print(f"long_context: error: {exc}", file=sys.stderr)
        return 2
    loaded = load_model(cfg.model)
    print(f"{loaded.source.name} ({loaded.model.dtype}, {torch.get_num_threads()} threads); "
          f"sink {cache.sink_tokens}, window {cache.window_tokens}, block {cache.block_size}", file=sys.stderr)
    print(HEADER, file=sys.stderr)
    # `past_key_values` is the keyword every supported transformers version takes
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    ours = bench_ours(cfg, loaded, sizes, args.decode_tokens, args.rounds)
    theirs = [] if args.skip_transformers else bench_transformers(loaded, sizes, args.decode_tokens, args.hf_chunk)
    print(HEADER)
    for r in ours + theirs:
        print(_format(r))
    print(json.dumps({**summary(ours, cache), "rows": [asdict(r) for r in ours + theirs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
