"""Paged attention kernels on a GPU: decode bandwidth against the device's peak, and end to end.

    python bench/kernels.py                 # the whole run: sweep + end to end
    python bench/kernels.py --skip-e2e      # kernels only

1. Decode attention (`paged_decode`) for batch 1..256 x context 1k..64k on one
   layer of a Llama-3-8B shape (32 heads, 8 KV heads, head_dim 128, bf16,
   blocks of 16, shuffled tables): achieved bandwidth = bytes of K and V read
   / time (L2 flushed between runs by triton.testing.do_bench), and its share
   of the device's peak HBM bandwidth.
2. End to end: decode tokens/s of the bundled model with
   `--attention-backend triton` against `torch`, same prompts, greedy.

Prints a table, then one JSON line. Without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch



def peak_tbps(name: str) -> float | None:
    """Peak HBM bandwidth of the known devices, by name; None when unknown."""
    if "H200" in name:
        return 4.8
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return 3.35
    if "A100" in name and "80GB" in name:
        return 2.0
    return None


def make_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype):
    """A pool holding `batch` sequences of `context` tokens in shuffled blocks, and a decode query."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key = torch.randn(shape, device="cuda", dtype=dtype)
    value = torch.randn(shape, device="cuda", dtype=dtype)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    t = torch.arange(context + block_size, device="cuda", dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim))
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, key, value, tables, seq_lens, emb.cos(), emb.sin()


def sweep(args, peak: float | None) -> list[dict]:
    import triton.testing

    from streamchat.kernels.decode import paged_decode

    rows = []
    elem = torch.tensor([], dtype=torch.bfloat16).element_size()
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
            if kv_bytes > args.max_pool_gib * (1 << 30):
                rows.append(dict(batch=batch, context=context, skipped="pool over --max-pool-gib"))
                continue
            q, key, value, tables, seq_lens, cos, sin = make_case(
                batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, torch.bfloat16)
            ms = triton.testing.do_bench(
                lambda: paged_decode(q, key, value, tables, seq_lens, cos, sin, args.head_dim ** -0.5),
                warmup=25, rep=100)
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            rows.append(dict(batch=batch, context=context, us=round(ms * 1e3, 1), tbps=round(tbps, 3),
                             of_peak=round(tbps / peak, 3) if peak else None))
            del q, key, value, tables
            torch.cuda.empty_cache()
    return rows


def decode_tokens_per_s(backend: str, batch: int, max_tokens: int) -> float:
    """Greedy decode tokens/s of the bundled model: (tokens(N) - tokens(1)) / (time(N) - time(1))."""
    from streamchat.config import Config, ModelConfig
    from streamchat.llm import LLM

    llm = LLM(Config(model=ModelConfig(attention_backend=backend)))
    prompts = [f"Write a long story about cache number {i}." for i in range(batch)]
    llm.chat(prompts, max_tokens=8)  # warm-up: kernels compiled, allocator primed

    def run(n: int) -> tuple[int, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        replies = llm.chat(prompts, max_tokens=n)
        torch.cuda.synchronize()
        return sum(len(r.token_ids) for r in replies), time.perf_counter() - start

    tokens_1, time_1 = run(1)
    tokens_n, time_n = run(max_tokens)
    return (tokens_n - tokens_1) / max(time_n - time_1, 1e-9)


def print_table(name: str, peak: float | None, rows: list[dict], e2e: dict) -> None:
    print(f"device: {name}; peak HBM bandwidth: {f'{peak} TB/s' if peak else 'unknown'}")
    print(f"{'batch':>6} {'context':>8} {'time us':>10} {'TB/s':>8} {'of peak':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>6} {r['context']:>8} {'skipped: ' + r['skipped']:>28}")
        else:
            share = f"{r['of_peak']:.0%}" if r["of_peak"] is not None else "unknown"
            print(f"{r['batch']:>6} {r['context']:>8} {r['us']:>10.1f} {r['tbps']:>8.3f} {share:>8}")
    for backend, rate in e2e.items():
        print(f"end to end, bundled model, --attention-backend {backend}: {rate:.1f} decode tokens/s")


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-pool-gib", type=float, default=40.0, help="skip sweep points whose K+V exceed this")
    p.add_argument("--e2e-batch", type=int, default=16)
    p.add_argument("--e2e-tokens", type=int, default=128)
    p.add_argument("--skip-e2e", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU on this machine; nothing to measure")
        return 0
    name = torch.cuda.get_device_name()
    peak = peak_tbps(name)
    rows = sweep(args, peak)
    e2e = {} if args.skip_e2e else {b: decode_tokens_per_s(b, args.e2e_batch, args.e2e_tokens)
                                    for b in ("torch", "triton")}
    print_table(name, peak, rows, e2e)
    print(json.dumps(dict(bench="kernels", device=name, peak_tbps=peak, decode_attention=rows,
                          e2e_decode_tokens_per_s={k: round(v, 1) for k, v in e2e.items()},
                          shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                     block_size=args.block_size, dtype="bfloat16"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
