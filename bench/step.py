"""Decode step time of the model runner at N sessions x C cached tokens: what one engine step costs.

    python bench/step.py                                  # 16 sessions x ~2,050 tokens, the bundled model
    python bench/step.py --sessions 16 --cached 2050 --steps 20 --threads 2 --dtype auto --profile

Builds the runner and a cache manager with the daemon's defaults (blocks of
16, 4 sink tokens, a 2,048-token window), gives every session `--cached`
tokens of random K/V (no prefill: a decode step costs
the same whatever the values), then times `--steps` decode steps of all
sessions at once through `ModelRunner.execute` (each step appends one token
per session, evicting as the daemon would once the window is full). Prints
the median and spread of the step's wall time and its median CPU time (all
threads of the process: steadier than wall time when other work shares the
machine), then one JSON line. `--profile` adds torch's profiler table of one
step's operators. `--mass` alternates plain steps with steps that also
compute the attention mass per block (`ModelRunner.execute_with_mass`, what
an h2o session's step costs) and reports both medians and their ratio.
`--pool-gib G` puts the sessions in a pool of G GiB whose free blocks come
in random order, as in a daemon that has run a while (sessions come and go,
windows slide), instead of in one run of blocks each: 16 sessions x 2,300
tokens, int8 pool, took 110.2 and 122.2 ms a step scattered over 3 GiB
against 95.6 and 110.1 in order (2026-12-06, 2-core EPYC, runs alternating). `--sample` times each step's sampling too (the model's default params, with
the sessions' tokens as the penalties' history), as the daemon's
`streamchat_decode_step_seconds_total` counts it.

Variants, timed step by step in turn (A B C A B C ...) so that a busy host
slows them alike: `--against OLD.c` (repeatable) adds another version of the
CPU kernels (kernels/cpu_decode.c as it was, e.g. `git show
main:kernels/cpu_decode.c > /tmp/old.c`) running the same model and pool;
`--kv-dtype float,int8` a pool per KV storage; `--decode-activations
float32,int8` a model per activation format of the grouped products. One
session's decode speed before and after a kernel change:

    python bench/step.py --sessions 1 --cached 200 --steps 60 --against /tmp/old.c

Uses only what the runner has offered since before issue #15 (runner,
manager, StepBatch), so the same file times an older checkout: run it with
that checkout first on PYTHONPATH and interleave the runs (A B A B) on a
shared machine (without the variant flags, which are newer).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

from streamchat.cache.block_pool import BlockPool  # noqa: E402
from streamchat.cache.manager import KVCacheManager  # noqa: E402
from streamchat.config import CacheConfig, ModelConfig  # noqa: E402
from streamchat.kernels import cpu  # noqa: E402
from streamchat.model.batch import SeqChunk, StepBatch  # noqa: E402
from streamchat.model.runner import ModelRunner, load_model  # noqa: E402
from streamchat.model.sampling import sample  # noqa: E402
from streamchat.model.sampling_adjust import TokenHistory  # noqa: E402
from streamchat.model.sampling_params import REPETITION_WINDOW, load_model_defaults  # noqa: E402


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--cached", type=int, default=2050, help="tokens in each session's cache before timing")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--mass", action="store_true", help="alternate with steps that compute h2o's attention mass")
    p.add_argument("--kv-dtype", default="float", help="KV storage, or several comma-separated (float,int8)")
    p.add_argument("--pool-gib", type=float, default=0,
                   help="a pool of this size, its free blocks in random order as a long-running daemon's "
                        "(the daemon's default pool here: 3); 0: just the blocks the sessions need, in order")
    p.add_argument("--decode-activations", default="float32", help="float32, mixed, int8, or several comma-separated")
    p.add_argument("--against", action="append", default=[], help="another cpu_decode.c to time alongside")
    p.add_argument("--sample", action="store_true",
                   help="time each step with its sampling too, as the daemon's step does: the model's default "
                        "params (generation_config.json), with each session's tokens as the penalties' history")
    return p.parse_args(argv)


class Sessions:
    """`n` sequences of one manager, filled with `cached` tokens each, stepped one token at a time."""

    def __init__(self, runner: ModelRunner, cache: CacheConfig, n: int, cached: int, seed: int = 0,
                 scatter: bool = False) -> None:
        self.runner, self.rng = runner, random.Random(seed)
        pool = BlockPool(runner.num_blocks)
        if scatter:  # a long-running daemon's free list: blocks in no order (sessions come and go, windows slide)
            ids = [pool.allocate() for _ in range(pool.num_usable)]
            self.rng.shuffle(ids)
            for block_id in ids:
                pool.free(block_id)
        self.mgr = KVCacheManager(pool, cache.block_size, cache.sink_tokens, cache.window_tokens,
                                  prefix_sharing=False)
        self.seqs = [self.mgr.new_seq() for _ in range(n)]
        vocab = runner.model.shape.vocab_size
        for seq in self.seqs:  # chunks no longer than an append may be
            for start in range(0, cached, self.mgr.max_chunk):
                ids = [self.rng.randrange(vocab) for _ in range(min(self.mgr.max_chunk, cached - start))]
                self.mgr.append(seq, ids)
        gen = torch.Generator().manual_seed(seed)
        for kv in runner.kv_caches:  # values do not change the cost; zeros would make softmax trivial
            for t in (kv.key, kv.value):
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))

    def batch(self) -> StepBatch:
        chunks = []
        for seq in self.seqs:
            ids = [self.rng.randrange(self.runner.model.shape.vocab_size)]
            placed = self.mgr.append(seq, ids)
            chunks.append(SeqChunk(ids, placed.positions, placed.slots, list(seq.block_ids), True))
        return StepBatch(decode=chunks)


class Variant(NamedTuple):
    """One way of running the step: a runner (model, pool) with its sessions, and the kernel library."""

    name: str
    runner: ModelRunner
    sessions: Sessions
    library: object  # the CPU kernels' ctypes library (common.use_library); None without them


def variants(args) -> list[Variant]:
    """Every (activations, KV dtype, kernel version) the flags ask for; versions share a runner."""
    acts, kv_dtypes = args.decode_activations.split(","), args.kv_dtype.split(",")
    libs = [("this", cpu.library())] + [(Path(a).stem, common.kernel_version(Path(a))) for a in args.against]
    out = []
    for act in acts:
        loaded = load_model(ModelConfig(dtype=args.dtype, decode_activations=act))
        per_seq_blocks = -(-(args.cached + len(libs) * (args.warmup + args.steps + 1) + 64) // 16)
        for kv in kv_dtypes:
            blocks = {"kv_memory_gib": args.pool_gib} if args.pool_gib else {
                "num_blocks": args.sessions * per_seq_blocks + 8}
            cache = CacheConfig(kv_dtype=kv, **blocks)
            runner = ModelRunner(loaded, cache)
            sessions = Sessions(runner, cache, args.sessions, args.cached, scatter=bool(args.pool_gib))
            for lib_name, lib in libs if act == "float32" else libs[:1]:  # older kernels: float32 only
                name = " ".join([lib_name] + ([f"kv={kv}"] if len(kv_dtypes) > 1 else [])
                                + ([f"x={act}"] if len(acts) > 1 else []))
                out.append(Variant(name, runner, sessions, lib))
    return out


def step(v: Variant, mass: bool = False, params=None) -> tuple[float, float]:
    """(wall, CPU) seconds of one decode step of all v's sessions; with `params`, its sampling too."""
    if v.library is not None:
        common.use_library(v.library)
    batch = v.sessions.batch()  # scheduling work is not the runner's: left out of the time
    start, cpu_start = time.perf_counter(), time.process_time()
    logits = (v.runner.execute_with_mass if mass else v.runner.execute)(batch)
    if params is not None:
        seqs = v.sessions.seqs
        history = [TokenHistory(seq.token_ids[-REPETITION_WINDOW:], seq.token_ids[-64:]) for seq in seqs]
        sample(logits, [params] * len(seqs), [None] * len(seqs), history if params.penalized else None)
    return time.perf_counter() - start, time.process_time() - cpu_start


def summary(args, v: Variant, times: list[float], cpu_times: list[float]) -> dict:
    loaded, s = v.runner.loaded, v.runner.model.shape
    cached = [len(seq.token_ids) for seq in v.sessions.seqs]
    ms = sorted(t * 1e3 for t in times)
    return dict(bench="step", sessions=args.sessions, cached_tokens=round(statistics.mean(cached)),
                model=loaded.source.name, dtype=str(loaded.model.dtype), layers=s.num_layers,
                threads=torch.get_num_threads(), backend=loaded.model.backend.name, steps=args.steps,
                step_ms_median=round(statistics.median(ms), 1), step_ms_p10=round(ms[len(ms) // 10], 1),
                step_ms_p90=round(ms[(9 * len(ms)) // 10], 1),
                cpu_ms_median=round(statistics.median(cpu_times) * 1e3, 1))


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vs = variants(args)
    params = load_model_defaults(vs[0].runner.loaded.source.folder) if args.sample else None
    for _ in range(args.warmup):
        for v in vs:
            step(v, params=params)
    times = {v.name: [] for v in vs}
    cpu_times = {v.name: [] for v in vs}
    mass_cpu = []
    for i in range(args.steps):
        for v in vs[i % len(vs):] + vs[:i % len(vs)]:  # each variant leads in turn
            wall, used = step(v, params=params)
            times[v.name].append(wall)
            cpu_times[v.name].append(used)
        if args.mass:  # interleaved (A B A B): the machine's load hits both alike
            mass_cpu.append(step(vs[0], mass=True)[1])
    rows = {v.name: summary(args, v, times[v.name], cpu_times[v.name]) for v in vs}
    for v in vs:
        row = rows[v.name]
        print(f"{v.name + ': ' if len(vs) > 1 else ''}{args.sessions} sessions x {row['cached_tokens']} cached "
              f"tokens, {row['dtype']}, {row['threads']} threads, {row['backend']} attention: decode step median "
              f"{row['step_ms_median']} ms (p10 {row['step_ms_p10']}, p90 {row['step_ms_p90']}), "
              f"CPU time {row['cpu_ms_median']} ms")
    row = rows[vs[0].name]
    if args.mass:
        plain, mass = statistics.median(cpu_times[vs[0].name]) * 1e3, statistics.median(mass_cpu) * 1e3
        row.update(mass_cpu_ms_median=round(mass, 1), mass_overhead=round(mass / plain - 1, 4))
        print(f"with attention mass (h2o): CPU time {mass:.1f} ms, {100 * (mass / plain - 1):+.1f}%")
    if args.profile:
        from torch.profiler import profile

        batch = vs[0].sessions.batch()
        with profile() as prof:
            vs[0].runner.execute(batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if len(vs) > 1:
        row = dict(bench="step", variants=rows)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
