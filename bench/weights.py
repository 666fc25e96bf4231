"""Decode tokens/s of one stream under each weight format (--weights), against transformers.

    python bench/weights.py                                   # bf16, int8, int4; transformers fp32 and bf16
    python bench/weights.py --num-threads 1 --repeats 5       # on a machine shared with other work
    python bench/weights.py --weights bf16,int4 --tokens 16 --repeats 1 --skip-transformers   # smoke

One session, a user message of about --context-tokens tokens (the shipped
Botchan), a greedy reply of --tokens tokens with end-of-turn switched off so
every run decodes exactly that many. A decode step is one engine step that
fed a sampled token back (sampling and detokenizing included); prefill is not
timed. Every format's model is loaded at the start and the formats take
turns, one reply each, --repeats times, so other load on the machine falls on
all of them alike; a format's figure is its median reply. transformers runs
the same weights (the converted folder) with a DynamicCache, the same prompt
tokens, and is timed per single-token forward the same way. "bf16" is the
issue's name for dense weights in the model's --dtype (float32 on a CPU
without bf16 instructions). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings

import common

FORMATS = ("bf16", "int8", "int4")


def parse_args(argv):
    from streamchat import settings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=",".join(FORMATS), help="formats, comma-separated (auto allowed)")
    p.add_argument("--context-tokens", type=int, default=150, help="about this many prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded per reply")
    p.add_argument("--repeats", type=int, default=3, help="replies per format (median)")
    p.add_argument("--skip-transformers", action="store_true")
    settings.add_flags(p, ("model",), skip=("weights",))
    return p.parse_args(argv)


def load_all(model_cfg, formats: list[str]) -> dict:
    from streamchat.config import CacheConfig, Config
    from streamchat.llm import LLM
    from streamchat.model.runner import load_model

    llms = {}
    for fmt in formats:
        loaded = load_model(dataclasses.replace(model_cfg, weights=fmt))
        llm = LLM(Config(model=model_cfg, cache=CacheConfig(kv_memory_gib=0.25)), loaded)
        common.disable_eos(llm.engine)
        llms[f"{fmt}->{loaded.weights}" if fmt == "auto" else fmt] = llm
    return llms


def prompt_text(tokenizer, context_tokens: int) -> str:
    return common.botchan_prefix(tokenizer, max(1, context_tokens - 20)) + "\n\nWhat happens next?"


def ours_reply(llm, text: str, tokens: int) -> list[float]:
    """Wall seconds of each decode step of one greedy reply in a fresh session."""
    from streamchat.engine.events import ResponseFinished
    from streamchat.model.sampling import SamplingParams

    engine, steps = llm.engine, []
    sid = f"bench-{time.monotonic_ns()}"
    engine.open_session(sid, "")
    engine.add_item(sid, "user", text)
    engine.start_response(sid, sid, SamplingParams(), tokens)
    finished = False
    while not finished:
        decoded, started = engine.metrics.decode_tokens, time.perf_counter()
        events = engine.step()
        if engine.metrics.decode_tokens > decoded:
            steps.append(time.perf_counter() - started)
        finished = any(isinstance(e, ResponseFinished) and e.response_id == sid for e in events)
    engine.close_session(sid)
    return steps


def hf_reply(model, ids: list[int], tokens: int) -> list[float]:
    """Wall seconds of each single-token forward of a greedy reply (prefill untimed)."""
    import torch
    from transformers import DynamicCache

    steps = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(tokens - 1):  # the first token comes from the prefill, as in ours
            started = time.perf_counter()
            token = logits.argmax(-1, keepdim=True)  # (1, 1)
            logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
            steps.append(time.perf_counter() - started)
    return steps


def load_transformers(loaded) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    return {f"transformers {name}": AutoModelForCausalLM.from_pretrained(loaded.source.folder, dtype=dtype).eval()
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def run(llms: dict, hfs: dict, text: str, ids: list[int], tokens: int, repeats: int) -> dict[str, list[float]]:
    """Per entry: decode tok/s of each reply, the entries taking turns."""
    rates: dict[str, list[float]] = {name: [] for name in [*llms, *hfs]}
    for _ in range(repeats):
        for name, llm in llms.items():
            steps = ours_reply(llm, text, tokens)
            rates[name].append(len(steps) / sum(steps))
        for name, model in hfs.items():
            steps = hf_reply(model, ids, tokens)
            rates[name].append(len(steps) / sum(steps))
        print(" ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), file=sys.stderr, flush=True)
    return rates


def report(rates: dict[str, list[float]], llms: dict, meta: dict) -> None:
    tok_s = {name: statistics.median(r) for name, r in rates.items()}
    dense = tok_s.get("bf16")
    hf32 = tok_s.get("transformers fp32")
    print(f"{'':22}{'tok/s':>8}{'weights MiB':>13}{'vs ours bf16':>14}{'vs transformers fp32':>22}")
    for name, rate in tok_s.items():
        mib = weight_mib(llms[name].loaded.model) if name in llms else None
        print(f"{name:22}{rate:8.1f}{common.fmt(mib, 13)}{common.fmt(common.ratio(rate, dense), 14, 2)}"
              f"{common.fmt(common.ratio(rate, hf32), 22, 2)}")
    ratios = {name: {"vs_bf16": common.ratio(rate, dense), "vs_transformers_fp32": common.ratio(rate, hf32)}
              for name, rate in tok_s.items()}
    print(json.dumps(common.rounded({"bench": "weights", **meta, "tok_s": tok_s, "ratios": ratios})))


def weight_mib(model) -> float:
    """Bytes of the projections and the head as served (the embedding table and norms are not counted)."""
    layers = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return sum(lin.nbytes for lin in [*layers, model.lm_head]) / (1 << 20)


def main(argv: list[str] | None = None) -> int:
    common.passive_omp()
    args = parse_args(argv)
    import torch

    from streamchat import settings
    from streamchat.config import WEIGHTS, ConfigError

    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    try:
        bad = [f for f in formats if f not in WEIGHTS]
        if bad:
            raise ConfigError(f"--weights: unknown {bad[0]!r}; choose from {', '.join(WEIGHTS)}")
        model_cfg = settings.load(args).model
    except ConfigError as exc:
        print(f"weights: error: {exc}", file=sys.stderr)
        return 2
    llms = load_all(model_cfg, formats)
    first = next(iter(llms.values()))
    text = prompt_text(first.tokenizer, args.context_tokens)
    ids = common.chat_inputs(first.engine.chat, [text])[0]
    hfs = {} if args.skip_transformers else load_transformers(first.loaded)
    # `past_key_values` is the keyword every supported transformers version takes
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    print(common.describe(first.loaded) + f"; {len(ids)} prompt tokens, {args.tokens} decoded, "
          f"{args.repeats} repeats", file=sys.stderr)
    rates = run(llms, hfs, text, ids, args.tokens, args.repeats)
    report(rates, llms, {"dtype": str(first.loaded.model.dtype), "threads": torch.get_num_threads(),
                         "prompt_tokens": len(ids), "tokens": args.tokens, "repeats": args.repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
