"""Decode throughput: our runner against transformers `generate` in one process, and llama-server.

(a) one session's tokens/s, (b) aggregate tokens/s of --batch concurrent
sequences; transformers run one after another and as one left-padded
batch; with --llama-server, llama.cpp's server on the same GGUF serves the
same prompts (one stream, then --batch streams on as many slots). Every
side produces exactly --tokens tokens per reply (EOS off) and is timed from
the request to its last token, prefill included. Each figure is the median
of --repeats runs. Prints a table and one JSON line with the ratios.

    python bench/decode.py [--weights int4] [--tokens 128] [--batch 16] \\
        [--llama-server "$(../shared/tools/build-llama-server.sh)"]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

PROMPTS = ["Tell me a story about a dragon.", "Explain how a rainbow forms.", "Write a poem about autumn.",
           "Describe the city of Paris.", "What is machine learning?", "Give advice for a job interview.",
           "Summarize the plot of Hamlet.", "How do airplanes fly?"]
TARGET_SINGLE_VS_LLAMA = 0.5
TARGET_BATCH_VS_LLAMA = 1.0


def median_rate(fn, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def ours(llm, prompts: list[str], tokens: int) -> int:
    replies = llm.chat(prompts, max_tokens=tokens, params=None)
    return sum(len(r.token_ids) for r in replies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server binary (the peer)")
    ap.add_argument("--skip-transformers", action="store_true")
    common.add_model_flags(ap)
    args = ap.parse_args()

    import torch

    from streamchat.config import CacheConfig, Config
    from streamchat.llm import LLM

    model_cfg = common.model_config(args)
    llm = LLM(Config(model=model_cfg, cache=CacheConfig(kv_memory_gib=0.5)))
    common.disable_eos(llm.engine)
    print(common.describe(llm.loaded), file=sys.stderr, flush=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    ours(llm, prompts[:2], 4)  # warm-up
    r = {"ours_1": median_rate(lambda: ours(llm, prompts[:1], args.tokens), args.repeats),
         "ours_n": median_rate(lambda: ours(llm, prompts, args.tokens), args.repeats)}
    if not args.skip_transformers:
        hf = common.load_transformers(llm.loaded)
        inputs = common.chat_inputs(llm.engine.chat, prompts)
        common.hf_sequential(hf, inputs[:1], 4)
        r["hf_1"] = median_rate(lambda: common.hf_sequential(hf, inputs[:1], args.tokens), args.repeats)
        r["hf_seq_n"] = median_rate(lambda: common.hf_sequential(hf, inputs, args.tokens), 1)
        r["hf_pad_n"] = median_rate(lambda: common.hf_padded(hf, inputs, args.tokens,
                                                             llm.tokenizer.pad_token_id or 0), args.repeats)
        del hf
    threads = torch.get_num_threads()
    if args.llama_server:
        from peers import llama_rates

        for key, batch in (("llama_1", prompts[:1]), ("llama_n", prompts)):
            rounds = llama_rates(args.llama_server, batch, args.tokens, threads=threads, repeats=args.repeats)
            r[key] = statistics.median(x["tok_s"] for x in rounds)
    ratios = {name: common.ratio(r.get(a), r.get(b)) for name, a, b in (
        ("single_vs_hf", "ours_1", "hf_1"), ("batch_vs_hf_sequential", "ours_n", "hf_seq_n"),
        ("batch_vs_hf_padded", "ours_n", "hf_pad_n"), ("single_vs_llama", "ours_1", "llama_1"),
        ("batch_vs_llama", "ours_n", "llama_n"))}
    n = args.batch
    print(f"weights={model_cfg.weights} threads={threads} tokens={args.tokens}")
    print(f"{'':34}{'tok/s':>10}")
    rows = [("ours, 1 session", "ours_1", None, None), ("transformers generate, 1", "hf_1", "single_vs_hf", None),
            ("llama-server, 1 stream", "llama_1", "single_vs_llama", TARGET_SINGLE_VS_LLAMA),
            (f"ours, {n} sessions", "ours_n", None, None),
            (f"transformers, {n} sequential", "hf_seq_n", "batch_vs_hf_sequential", None),
            (f"transformers, {n} padded batch", "hf_pad_n", "batch_vs_hf_padded", None),
            (f"llama-server, {n} slots", "llama_n", "batch_vs_llama", TARGET_BATCH_VS_LLAMA)]
    for label, key, ratio, target in rows:
        if key not in r:
            continue
        tail = f"   ours/this {ratios[ratio]:.2f}x" if ratio else ""
        print(f"{label:34}{r[key]:10.1f}{tail}{f' (target >= {target:g})' if target else ''}")
    print(json.dumps({"bench": "decode", "weights": model_cfg.weights, "batch": n, "tokens": args.tokens,
                      **{k: round(v, 2) for k, v in r.items()},
                      **{k: round(v, 3) for k, v in ratios.items() if v is not None}}))


if __name__ == "__main__":
    main()
