"""The CPU kernels alone (kernels/cpu_decode.c): decode attention and the grouped weight products.

    python bench/cpu_kernels.py                          # this checkout's kernel, 2 threads
    python bench/cpu_kernels.py --against old.c          # and another version of cpu_decode.c, interleaved
    git show HEAD~1:kernels/cpu_decode.c > /tmp/old.c && python bench/cpu_kernels.py --against /tmp/old.c

Attention: `--sessions` sequences of `--context` tokens in the bundled model's
shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16), one layer, the
blocks scattered at random over a pool of `--pool-blocks` blocks (as a busy
pool holds them), and once more with every sequence reading the same 8 blocks
(all in cache: the arithmetic alone); float32 pools, or int8 ones with their
scales with `--int8`. Products: `Groups.matmul` at 1 and 16
rows over the bundled model's matrix shapes (q, k, v, o, gate, up, down, and
the 49,152-row output head) with random 4-bit codes.

Every version runs in the same process, alternating call by call, so a busy
host slows them alike (this 2-core machine varies 10-25% between runs).
Prints the minimum and the 25th percentile of each; outputs are checked
against the first version (max abs difference); the last line is JSON (the
25th percentiles, ms). An older source whose entry points took other
arguments reports n/a for them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch  # noqa: E402

import common  # noqa: E402 - bench/ is this script's folder
from streamchat.kernels import cpu  # noqa: E402

MATRICES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer
HEAD = (49152, 576)


def load(source: Path, cache: Path):
    """The kernel library built from `source` (a cpu_decode.c, beside this checkout's other sources: see
    common.kernel_version) into its own cache folder."""
    os.environ["STREAMCHAT_KERNEL_CACHE"] = str(cache)
    return common.kernel_version(source)


def timed(libs: list, reps: int, call) -> list[list[float]]:
    times = [[] for _ in libs]
    for _ in range(reps):
        for i, lib in enumerate(libs):
            common.use_library(lib)
            t = time.perf_counter()
            call(i)
            times[i].append(time.perf_counter() - t)
    return times


def diffs(outs: list) -> list[float | None]:
    return [None if o is None else (o - outs[0]).abs().max().item() for o in outs]


RESULTS: dict[str, dict[str, float | None]] = {}


def p25(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 4]


def record(key: str, names: list[str], values: list[float | None]) -> None:
    for name, v in zip(names, values):
        RESULTS.setdefault(name, {})[key] = None if v is None or v != v else round(v * 1e3, 3)


def report(label: str, names: list[str], times: list[list[float]], diffs: list[float | None]) -> None:
    for name, ts, diff in zip(names, times, diffs):
        if diff is None:  # an older source whose entry point had another signature
            print(f"{label:34s} {name:12s} n/a (the call returned no result)")
            continue
        ts = sorted(ts)
        print(f"{label:34s} {name:12s} min {ts[0] * 1e3:8.3f} ms  p25 {ts[len(ts) // 4] * 1e3:8.3f} ms  "
              f"max diff {diff:.1e}")


def attention(args, libs, names) -> None:
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    blocks = -(-args.context // bs)
    g = torch.Generator().manual_seed(0)
    lens = torch.full((args.sessions,), args.context, dtype=torch.int32)
    cos, sin = torch.randn(args.context + bs, head_dim), torch.randn(args.context + bs, head_dim)
    q = torch.randn(args.sessions, heads, head_dim, generator=g)
    n_partial = cpu.scratch_sizes(args.sessions, heads, kv_heads, head_dim, blocks, bs)[0]
    partial = torch.empty(n_partial)
    pool_blocks = max(args.pool_blocks, args.sessions * blocks)
    if args.int8:  # codes and a scale per row, as --kv-dtype int8 stores them
        kc = torch.randint(-127, 128, (pool_blocks, bs, kv_heads, head_dim), dtype=torch.int8, generator=g)
        vc = torch.randint(-127, 128, (pool_blocks, bs, kv_heads, head_dim), dtype=torch.int8, generator=g)
        scales = {"k_scale": torch.rand(pool_blocks, bs, kv_heads, generator=g) * 0.01,
                  "v_scale": torch.rand(pool_blocks, bs, kv_heads, generator=g) * 0.01}
    else:
        kc = torch.randn(pool_blocks, bs, kv_heads, head_dim, generator=g)
        vc = torch.randn(pool_blocks, bs, kv_heads, head_dim, generator=g)
        scales = {}
    cases = {
        "attention, blocks scattered": torch.randperm(pool_blocks, generator=g)[:args.sessions * blocks],
        "attention, 8 blocks in cache": torch.arange(args.sessions * blocks) % 8,
    }
    for label, table in cases.items():
        table = table.view(args.sessions, blocks).to(torch.int32).contiguous()
        outs = [None] * len(libs)

        def call(i):
            outs[i] = cpu.paged_decode(q, kc, vc, table, lens, cos, sin, head_dim ** -0.5, partial=partial,
                                       **scales)

        times = timed(libs, args.reps, call)
        report(f"{label} ({args.sessions}x{args.context}{', int8' if args.int8 else ''})", names, times, diffs(outs))
        record("attention_scattered_ms" if "scattered" in label else "attention_cached_ms", names,
               [p25(ts) if o is not None else None for ts, o in zip(times, outs)])


def products(args, libs, names) -> None:
    g = torch.Generator().manual_seed(1)
    for rows in (1, 16):
        totals = [0.0] * len(libs)
        for n, k in MATRICES + [HEAD]:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            groups = cpu.Groups.from_codes(codes, torch.rand(n, k // 32, generator=g) * 0.01,
                                           torch.randn(n, k // 32, generator=g) * 0.01)
            x = torch.randn(rows, k, generator=g)
            outs = [None] * len(libs)

            def call(i):
                outs[i] = groups.matmul(x)

            times = timed(libs, args.reps, call)
            for i, ts in enumerate(times):
                totals[i] += p25(ts) if outs[i] is not None else float("nan")
            if (n, k) == HEAD:
                report(f"output head {n}x{k}, {rows} rows", names, times, diffs(outs))
        record(f"layer_and_head_{rows}_rows_ms", names, totals)
        for name, total in zip(names, totals):
            print(f"{'one layer + head, ' + str(rows) + ' rows (sum of p25)':34s} {name:12s} {total * 1e3:8.3f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], help="another cpu_decode.c to time alongside")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--context", type=int, default=2060)
    p.add_argument("--pool-blocks", type=int, default=40000, help="blocks in the pool the sessions are scattered over")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--int8", action="store_true", help="attention over int8 pools with their scales (--kv-dtype int8)")
    p.add_argument("--cache", default="/tmp/streamchat-bench-kernels", help="where each version is built")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sources = [cpu.cpu_build.SOURCES[0]] + [Path(a).resolve() for a in args.against]
    names = ["this"] + [Path(a).stem for a in args.against]
    libs = [load(src, Path(args.cache) / f"v{i}") for i, src in enumerate(sources)]
    print(f"{args.threads} threads; versions: " + ", ".join(f"{n} = {s}" for n, s in zip(names, sources)))
    attention(args, libs, names)
    products(args, libs, names)
    print(json.dumps({"bench": "cpu_kernels", "threads": args.threads, "sessions": args.sessions,
                      "context": args.context, "p25": RESULTS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
