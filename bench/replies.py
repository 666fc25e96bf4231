"""Do replies hold together? Loops and distinct-2 of open-ended replies under sampling settings.

    python bench/replies.py                                   # greedy against the model's defaults
    python bench/replies.py --try warm:temperature=0.7,min_p=0.05 --seeds 3
    python bench/replies.py --tokens 16 --prompts 2            # a smoke run

16 open-ended prompts (stories, explanations, lists), each in a new session
of the bundled model through `streamchat.llm.LLM` (all prompts batched in one
`chat` call), each reply up to --tokens tokens (EOS ends it earlier). For each
setting: a reply *loops* when some 8-token sequence occurs 3 or more times in
its token ids; distinct-2 is its distinct token bigrams over its bigrams.
Printed: per prompt and setting, the loop mark and distinct-2; per setting,
the loop count and the mean distinct-2 (averaged over --seeds seeds for
sampled settings). Target: at most 1 loop in 16 with the default setting.

Settings: `greedy` (temperature 0: today's default before issue #16),
`default` (what the daemon serves with: the model folder's
generation_config.json, else DEFAULT_PARAMS), and any --try NAME:FIELD=V,...
(SamplingParams fields over greedy's zeros).

Sampled settings run seeded (0..--seeds-1), so a run can be repeated.

Prints a table, then one JSON line. Never asserts; exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from collections import Counter  # noqa: E402

PROMPTS = [
    "Tell me a short story about a cat.", "Write a short story about a robot who learns to paint.",
    "Tell me a bedtime story about a dragon.", "Write a story about a lost dog finding its way home.",
    "Explain how a rainbow forms.", "Explain why the sky is blue.", "Explain how vaccines work.",
    "What is machine learning? Explain it simply.", "Explain how a car engine works.",
    "List ten things to do on a rainy day.", "List some tips for learning a new language.",
    "Give me a list of healthy breakfast ideas.", "List the planets of the solar system with a fact about each.",
    "Describe the city of Paris.", "Write a poem about autumn.", "What are the benefits of regular exercise?",
]
LOOP_NGRAM, LOOP_REPEATS = 8, 3
TARGET_LOOPS = 1


def loops(ids: list[int], n: int = LOOP_NGRAM, repeats: int = LOOP_REPEATS) -> bool:
    """Some n-token sequence occurs `repeats` or more times (overlapping occurrences count)."""
    grams = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return any(c >= repeats for c in grams.values())


def distinct2(ids: list[int]) -> float | None:
    """Distinct bigrams / bigrams; None for a reply under two tokens."""
    bigrams = list(zip(ids, ids[1:]))
    return len(set(bigrams)) / len(bigrams) if bigrams else None


def run_setting(llm, prompts: list[str], params, tokens: int, seeds: list[int]) -> dict:
    """Loop marks and distinct-2 per prompt, pooled over seeds (greedy runs once)."""
    runs = []
    for seed in seeds[:1] if params.greedy else seeds:
        replies = llm.chat(prompts, max_tokens=tokens, params=dataclasses.replace(params, seed=seed))
        runs.append([(loops(r.token_ids), distinct2(r.token_ids), len(r.token_ids), r.text) for r in replies])
    per_prompt = []
    for i in range(len(prompts)):
        d2 = [run[i][1] for run in runs if run[i][1] is not None]
        per_prompt.append({"loops": sum(run[i][0] for run in runs) / len(runs),
                           "distinct2": statistics.mean(d2) if d2 else None,
                           "tokens": statistics.mean(run[i][2] for run in runs), "text": runs[0][i][3]})
    d2_all = [p["distinct2"] for p in per_prompt if p["distinct2"] is not None]
    return {"params": dataclasses.asdict(params), "runs": len(runs),
            "loops": sum(p["loops"] for p in per_prompt), "loop_share": statistics.mean(p["loops"] for p in per_prompt),
            "distinct2_mean": statistics.mean(d2_all) if d2_all else None, "per_prompt": per_prompt}


def parse_try(text: str):
    """NAME:FIELD=V,FIELD=V -> (name, SamplingParams)."""
    from streamchat.model.sampling import SAMPLING_FIELDS, SamplingParams

    name, _, spec = text.partition(":")
    fields = {}
    for pair in filter(None, spec.split(",")):
        key, _, value = pair.partition("=")
        if key not in SAMPLING_FIELDS or key == "seed":
            raise argparse.ArgumentTypeError(f"not a sampling field: {key!r}")
        fields[key] = int(value) if key == "top_k" else float(value)
    try:
        return name, SamplingParams(**fields).validate()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def print_table(prompts: list[str], results: dict[str, dict]) -> None:
    names = list(results)
    print(f"{'prompt':44}" + "".join(f"{n[:16]:>18}" for n in names) + "   (loops / distinct-2)")
    for i, prompt in enumerate(prompts):
        cells = "".join(f"{results[n]['per_prompt'][i]['loops']:>9.2g} / {_d2(results[n]['per_prompt'][i]):>5}"
                        for n in names)
        print(f"{prompt[:43]:44}{cells}")
    print(f"{'loops (of ' + str(len(prompts)) + ')':44}" + "".join(f"{results[n]['loops']:>18.3g}" for n in names))
    print(f"{'mean distinct-2':44}" + "".join(f"{_d2({'distinct2': results[n]['distinct2_mean']}):>18}"
                                               for n in names))
    for n in names:
        shown = {k: v for k, v in results[n]["params"].items() if k != "seed"}
        print(f"  {n}: {shown}, {results[n]['runs']} run(s)")


def _d2(row: dict) -> str:
    return "-" if row["distinct2"] is None else f"{row['distinct2']:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200, help="most tokens per reply (default 200)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts (default 16)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per sampled setting, 0..N-1 (default 1)")
    p.add_argument("--try", dest="tries", action="append", type=parse_try, default=[], metavar="NAME:F=V,...",
                   help="another setting to measure, e.g. warm:temperature=0.7,top_p=0.9 (repeatable)")
    p.add_argument("--no-baselines", action="store_true", help="only the --try settings")
    p.add_argument("--show", action="store_true", help="print each setting's replies (first seed) to stderr")
    common.add_model_flags(p)
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.seeds <= 0 or not 0 < args.prompts <= len(PROMPTS):
        p.error(f"--tokens and --seeds must be positive, --prompts in 1..{len(PROMPTS)}")

    from streamchat.config import Config
    from streamchat.llm import LLM
    from streamchat.model.sampling import SamplingParams

    llm = LLM(Config(model=common.model_config(args)))
    print(common.describe(llm.loaded), file=sys.stderr, flush=True)
    settings = [] if args.no_baselines else [("greedy", SamplingParams()), ("default", llm.default_params)]
    settings += args.tries
    prompts, seeds = PROMPTS[:args.prompts], list(range(args.seeds))
    results = {}
    for name, params in settings:
        print(f"{name}: {params}", file=sys.stderr, flush=True)
        r = results[name] = run_setting(llm, prompts, params, args.tokens, seeds)
        print(f"  {name}: loops {r['loops']:g} of {len(prompts)}, mean distinct-2 "
              f"{_d2({'distinct2': r['distinct2_mean']})}", file=sys.stderr, flush=True)
        if args.show:
            for prompt, row in zip(prompts, r["per_prompt"]):
                print(f"--- {name}: {prompt}\n{row['text']}", file=sys.stderr, flush=True)
    print_table(prompts, results)
    for r in results.values():
        for row in r["per_prompt"]:
            del row["text"]
    print(json.dumps(common.rounded({
        "bench": "replies", "model": llm.loaded.source.name, "dtype": str(llm.loaded.model.dtype),
        "tokens": args.tokens, "prompts": len(prompts), "seeds": args.seeds, "settings": results,
        "target": {"default_loops_at_most": TARGET_LOOPS}})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
