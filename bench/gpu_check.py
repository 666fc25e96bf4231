"""Prove the GPU path on a lent GPU, with random weights (no model download): bench/gpu_check.sh runs it.

    python bench/gpu_check.py            # CUDA only: exits 2 with a message elsewhere
    python bench/gpu_check.py --smoke    # tiny shapes on CPU (Triton interpreted): the code runs, no figures

Four parts, each printing its lines, then one JSON line of every figure:

1. The decode kernel alone (`paged_decode`, bf16, tile 64 and one-block
   tiles) at batch 1/16/64 x context 4k/16k/64k, for the bundled model's
   attention shape (3 KV heads x 64) and Llama-3-8B's (8 x 128): the KV bytes
   it must read over its time, as a share of the device's HBM bandwidth.
2. Decode tok/s of the whole runner at 1/16/64 sessions x `--context`
   cached tokens, with and without CUDA graphs, for the bundled shape (all
   30 layers) and Llama-3-8B's (`--llama-layers`, 32 by default: all of
   them); the first step's logits with graphs are checked against the
   plain path's.
3. The number of compiled variants of each kernel over all of that (the JIT
   cache's own count, and `kernels.variants`' count of launch keys).
4. Host-tier copies (pinned, non_blocking, side stream) round-trip
   device -> host -> device bit-exactly; sampling on the device returns ids.

The K/V pools hold zeros: a decode step reads every cached byte whatever
the values, so its time does not depend on them (as bench/step.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's streamchat

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine "
           "with an NVIDIA GPU, or pass --smoke for a CPU run of its code at tiny shapes")

# name: (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab)
SHAPES = {"smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152),
          "llama-3-8b": (32, 4096, 32, 8, 128, 14336, 128256)}
SMOKE_SHAPE = (2, 64, 4, 2, 16, 128, 128)
PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100": 2039, "L40S": 864}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreted), no figures")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="4096,16384,65536", help="decode-kernel contexts (tokens)")
    p.add_argument("--sessions", default="1,16,64")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per session for tok/s")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration")
    p.add_argument("--llama-layers", type=int, default=32, help="layers of the Llama-3-8B-shaped model")
    p.add_argument("--peak-gbs", type=float, default=0, help="HBM bandwidth, GB/s (0: from the device)")
    args = p.parse_args()
    if args.smoke:
        args.batches, args.contexts, args.sessions, args.context, args.steps = "1,2", "32,64", "1,3", 20, 2
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def peak_gbs(device: torch.device, override: float) -> float:
    """GB/s of HBM: the flag, else clock x bus width (double data rate), else a table by name."""
    if override:
        return override
    props = torch.cuda.get_device_properties(device)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9
    return next((v for k, v in PEAK_GBS.items() if k in props.name), 0.0)


def timed(fn, iters: int, device: torch.device) -> float:
    """Seconds per call (after one warm-up), by CUDA events on a GPU, wall time on CPU."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def kernel_bandwidth(args, device, peak: float, figures: dict) -> None:
    """Part 1: the decode kernel's bytes over its time, as a share of HBM bandwidth."""
    from streamchat.kernels.decode import paged_decode, plan_decode

    bs, dtype = 16, torch.bfloat16
    shapes = {"smoke": SMOKE_SHAPE} if args.smoke else SHAPES
    for name, (_, _, heads, kv_heads, head_dim, _, _) in shapes.items():
        cos = torch.ones(max(ints(args.contexts)), head_dim, device=device)
        for batch in ints(args.batches):
            for context in ints(args.contexts):
                num_blocks = batch * context // bs
                pool = torch.zeros(num_blocks + 1, bs, kv_heads, head_dim, dtype=dtype, device=device)
                tables = (1 + torch.arange(num_blocks, device=device, dtype=torch.int32)).view(batch, -1)
                lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
                nbytes = 2 * num_blocks * bs * kv_heads * head_dim * pool.element_size()
                line = []
                for tile in (64, 16):
                    splits = plan_decode(batch, heads, kv_heads, head_dim, tables.shape[1], bs, device, block_n=tile)
                    sec = timed(lambda: paged_decode(q, pool, pool, tables, lens, cos, cos, 0.1, splits=splits),
                                1 if args.smoke else 20, device)
                    share = nbytes / sec / 1e9 / peak if peak else float("nan")
                    figures[f"kernel.{name}.b{batch}.c{context}.tile{tile}"] = {"us": sec * 1e6, "share": share}
                    line.append(f"tile {tile}: {sec * 1e6:9.1f} us {100 * share:5.1f}% of HBM")
                print(f"  decode kernel {name:13s} batch {batch:3d} context {context:6d}: " + " | ".join(line))
                pool = None  # free it before the next, larger one


def random_model(shape, device, dtype, backend):
    """A LlamaModel of random weights in `shape` (see SHAPES)."""
    from transformers import LlamaConfig

    from streamchat.model.llama import LlamaModel

    layers, hidden, heads, kv_heads, head_dim, inter, vocab = shape
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=131072, tie_word_embeddings=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype) * 0.02

    state = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, device=device,
                                                                                                dtype=dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, rows, cols in (("self_attn.q_proj", heads * head_dim, hidden),
                              ("self_attn.k_proj", kv_heads * head_dim, hidden),
                              ("self_attn.v_proj", kv_heads * head_dim, hidden),
                              ("self_attn.o_proj", hidden, heads * head_dim), ("mlp.gate_proj", inter, hidden),
                              ("mlp.up_proj", inter, hidden), ("mlp.down_proj", hidden, inter)):
            state[p + n + ".weight"] = rand(rows, cols)
        state[p + "input_layernorm.weight"] = torch.ones(hidden, device=device, dtype=dtype)
        state[p + "post_attention_layernorm.weight"] = torch.ones(hidden, device=device, dtype=dtype)
    return LlamaModel(config, state, dtype, device, backend)


class Sessions:
    """`num` sessions of `context` cached tokens in contiguous blocks; each step appends one token each."""

    def __init__(self, num: int, context: int, bs: int, blocks_each: int) -> None:
        self.bs, self.blocks_each = bs, blocks_each
        self.lens = [context] * num

    def batch(self, token_ids: list[int]):
        from streamchat.model.batch import SeqChunk, StepBatch

        chunks = []
        for i, (n, t) in enumerate(zip(self.lens, token_ids)):
            first = 1 + i * self.blocks_each
            table = list(range(first, first + n // self.bs + 1))
            chunks.append(SeqChunk([t], [n], [table[n // self.bs] * self.bs + n % self.bs], table, True))
            self.lens[i] = n + 1
        return StepBatch(decode=chunks)


def decode_rate(args, device, figures: dict) -> None:
    """Part 2: decode tok/s with and without graphs; graph logits against the plain path's."""
    from streamchat.config import CacheConfig
    from streamchat.model.attention import make_backend
    from streamchat.model.runner import LoadedModel, ModelRunner
    from streamchat.model.static_decode import StaticDecode

    bs, dtype = 16, torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {"smoke": SMOKE_SHAPE} if args.smoke else dict(SHAPES)
    if not args.smoke:
        shapes["llama-3-8b"] = (args.llama_layers, *SHAPES["llama-3-8b"][1:])
    modes = (False,) if device.type != "cuda" else (False, True)
    for name, shape in shapes.items():
        model = random_model(shape, device, dtype, make_backend("triton", device))
        max_sessions = max(ints(args.sessions))
        blocks_each = (args.context + args.steps * 2 + 8) // bs + 2
        cache = CacheConfig(block_size=bs, num_blocks=1 + max_sessions * blocks_each,
                            window_tokens=blocks_each * bs * 2)
        runner = ModelRunner(LoadedModel(None, model.config, None, model), cache, max_batch=max_sessions)
        for num in ints(args.sessions):
            tokens = [1] * num
            sessions = Sessions(num, args.context, bs, blocks_each)
            for graphs in modes:
                runner.static = StaticDecode(model, runner.kv_caches, bs, max_sessions, blocks_each, graphs)
                if graphs:  # the graph's logits against the plain path's, on the same step
                    check = sessions.batch(tokens)
                    sessions.lens = [n - 1 for n in sessions.lens]
                    got = runner.execute(check).clone()
                    ids, pos, meta, rows = runner.prepare(check)
                    want = model.forward(ids, pos, meta, runner.kv_caches, rows)
                    err = (got - want).abs().max().item()
                    figures[f"graph_vs_plain.{name}.s{num}"] = err
                    assert err < 0.05 * max(1.0, want.abs().max().item()), f"graph logits differ by {err}"
                for _ in range(2):  # warm-up (compiles, captures)
                    tokens = runner.execute(sessions.batch(tokens)).argmax(-1).tolist()
                start = time.perf_counter()
                for _ in range(args.steps):
                    tokens = runner.execute(sessions.batch(tokens)).argmax(-1).tolist()  # the ids come back
                rate = num * args.steps / (time.perf_counter() - start)
                figures[f"tok_s.{name}.s{num}.{'graphs' if graphs else 'eager'}"] = rate
                print(f"  decode {name:13s} {num:3d} sessions x {args.context} tokens, "
                      f"{'CUDA graphs' if graphs else 'eager'}: {rate:9.1f} tok/s")
        del runner, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def jit_counts(kernels: dict) -> dict[str, int]:
    """Compiled variants in each kernel's JIT cache (None under the interpreter, which compiles nothing)."""
    out = {}
    for module, names in kernels.items():
        for name in names:
            caches = getattr(getattr(module, name), "device_caches", None)
            out[name] = None if caches is None else sum(len(c[0]) for c in caches.values())
    return out


def copies_and_sampling(device, figures: dict) -> None:
    """Part 4: host-tier copies round-trip; sampling on the device."""
    from streamchat.model.kv_spec import FullAttentionSpec
    from streamchat.model.sampling import SamplingParams, make_generator, sample
    from streamchat.tiers.host import HostTier, copy_blocks

    spec = FullAttentionSpec(16, 2, 32, torch.float32)
    pools = [spec.allocate(9, device)]
    for t in pools[0]:
        t.normal_()
    before = [t.clone() for t in pools[0] if t is not None]
    host = HostTier([spec], 8, device)
    copy_blocks(pools, [3, 5, 7], host.caches, [1, 2, 3], host.stream)
    pools[0].key.zero_()
    pools[0].value.zero_()
    copy_blocks(host.caches, [1, 2, 3], pools, [2, 4, 6], host.stream)
    ok = all(torch.equal(t[[2, 4, 6]], b[[3, 5, 7]]) for t, b in zip(pools[0], before))
    ok = ok and not pools[0].key[[1, 3, 5, 7]].any()  # nothing else written
    figures["tier_round_trip_exact"] = ok
    print(f"  host tier round trip device -> host -> device, {'pinned side stream' if host.stream else 'CPU'}: "
          f"{'exact' if ok else 'DIFFERENT'}")
    logits = torch.randn(4, 1000, device=device)
    params = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, seed=3),
              SamplingParams(1.0, top_k=5, seed=4)]
    ids = sample(logits, params, [make_generator(p) for p in params])
    figures["sampled_ids"] = ids
    assert all(0 <= i < 1000 for i in ids) and ids[0] == int(logits[0].argmax())
    print(f"  sampling on {device.type}: ids {ids}")
    if not ok:
        raise SystemExit("gpu_check: the host-tier round trip changed the blocks")


def main() -> int:
    args = parse()
    if not args.smoke and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from streamchat.kernels import decode, prefill, write_kv
    from streamchat.kernels.variants import Variants

    device = torch.device("cpu" if args.smoke else "cuda")
    peak = 0.0 if args.smoke else peak_gbs(device, args.peak_gbs)
    name = "CPU (smoke: no figures)" if args.smoke else torch.cuda.get_device_name(device)
    print(f"gpu_check on {name}; HBM peak {peak:.0f} GB/s")
    figures: dict = {"device": name, "peak_gbs": peak}
    kernels = {decode: ["_decode_split_kernel", "_decode_reduce_kernel"], prefill: ["_prefill_kernel"],
               write_kv: ["_write_kv_kernel"]}
    started = time.perf_counter()
    with Variants(kernels) as part1:
        print("1. decode kernel, bf16, share of HBM bandwidth (tile 64 and one-block tiles)")
        kernel_bandwidth(args, device, peak, figures)
    with Variants(kernels) as part2:
        print("2. decode tok/s through the runner")
        decode_rate(args, device, figures)
    figures["variants.kernel_part"] = part1.counts()
    figures["variants.runner_part"] = part2.counts()
    figures["variants.jit_cache"] = jit_counts(kernels)
    print(f"3. compiled variants (launch keys): decode kernel alone {figures['variants.kernel_part']}; "
          f"runner steps {figures['variants.runner_part']}; JIT cache, all parts {figures['variants.jit_cache']}")
    print("4. tier copies and sampling")
    copies_and_sampling(device, figures)
    figures["seconds"] = time.perf_counter() - started
    print(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
