"""Decode throughput: our runner against transformers `generate`, in one process.

(a) one session's decode tokens/s, (b) aggregate decode tokens/s of 16
concurrent sequences; transformers run one after another and as one
left-padded batch. Each figure is the median of --repeats runs. Prints a
table and one JSON line with the ratios.

    python bench/decode.py [--dtype auto|float32|bfloat16] [--tokens 64] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from streamchat.config import CacheConfig, Config, ModelConfig
from streamchat.llm import LLM

PROMPTS = ["Tell me a story about a dragon.", "Explain how a rainbow forms.", "Write a poem about autumn.",
           "Describe the city of Paris.", "What is machine learning?", "Give advice for a job interview.",
           "Summarize the plot of Hamlet.", "How do airplanes fly?"]


def median_rate(fn, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def ours(llm: LLM, prompts: list[str], tokens: int) -> int:
    replies = llm.chat(prompts, max_tokens=tokens, params=None)
    return sum(len(r.token_ids) for r in replies)


def hf_inputs(llm: LLM, prompts: list[str]) -> list[list[int]]:
    chat = llm.engine.chat
    return [chat.bos_ids + chat.message("user", p) + chat.reply_prompt() for p in prompts]


def hf_sequential(model, inputs: list[list[int]], tokens: int) -> int:
    total = 0
    for ids in inputs:
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total += out.shape[1] - len(ids)
    return total


def hf_padded(model, inputs: list[list[int]], tokens: int, pad_id: int) -> int:
    width = max(len(i) for i in inputs)
    ids = torch.tensor([[pad_id] * (width - len(i)) + i for i in inputs])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in inputs])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(Config(model=ModelConfig(dtype=args.dtype), cache=CacheConfig(kv_memory_gib=0.5)))
    # Our replies may stop early at EOS; rates count the tokens actually generated.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.loaded.source.folder, dtype=llm.loaded.model.dtype).eval()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    inputs = hf_inputs(llm, prompts)
    ours(llm, prompts[:2], 4)  # warm-up
    hf_sequential(hf, inputs[:1], 4)
    r = {
        "ours_1": median_rate(lambda: ours(llm, prompts[:1], args.tokens), args.repeats),
        "hf_1": median_rate(lambda: hf_sequential(hf, inputs[:1], args.tokens), args.repeats),
        "ours_n": median_rate(lambda: ours(llm, prompts, args.tokens), args.repeats),
        "hf_seq_n": median_rate(lambda: hf_sequential(hf, inputs, args.tokens), 1),
        "hf_pad_n": median_rate(lambda: hf_padded(hf, inputs, args.tokens, llm.tokenizer.pad_token_id or 0),
                                args.repeats),
    }
    ratios = {"single_vs_hf": r["ours_1"] / r["hf_1"], "batch_vs_hf_sequential": r["ours_n"] / r["hf_seq_n"],
              "batch_vs_hf_padded": r["ours_n"] / r["hf_pad_n"]}
    n = args.batch
    print(f"dtype={llm.loaded.model.dtype} threads={torch.get_num_threads()} tokens={args.tokens}")
    print(f"{'':34}{'tok/s':>10}")
    print(f"{'ours, 1 session':34}{r['ours_1']:10.1f}")
    print(f"{'transformers generate, 1':34}{r['hf_1']:10.1f}   ratio {ratios['single_vs_hf']:.2f}x (target >= 1.0)")
    print(f"{f'ours, {n} sessions':34}{r['ours_n']:10.1f}")
    print(f"{f'transformers, {n} sequential':34}{r['hf_seq_n']:10.1f}   ratio {ratios['batch_vs_hf_sequential']:.2f}x (target >= 6)")
    print(f"{f'transformers, {n} padded batch':34}{r['hf_pad_n']:10.1f}   ratio {ratios['batch_vs_hf_padded']:.2f}x (target >= 1.2)")
    print(json.dumps({"bench": "decode", "dtype": str(llm.loaded.model.dtype), "batch": n, "tokens": args.tokens,
                      **{k: round(v, 2) for k, v in r.items()}, **{k: round(v, 3) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
