"""MLA (DeepSeek's latent attention): KV bytes per token, each KV dtype's cost on the latent, decode rates.

Four parts, each printed as a table; the last line is one JSON object.

    bytes    pool bytes per token and layer for the MLA model (one latent row: 512 + 64 values) against
             the same model with full heads (16 x (192 key + 128 value) values), per --kv-dtype
    ppl      `streamchat eval`'s perplexity (policies full and sink + window) per KV dtype on the latent,
             and the logits' distance from the float pool's (mean |delta| / std, top-1 agreement)
    decode   decode tokens/s at 1 and 16 sessions through the engine (streamchat.llm.LLM, EOS off),
             timed from every session's first token to the last; prefill excluded
    kernels  one layer's MLA decode attention on CPU: the C kernel (cpu_mla.c) against the torch
             reference, at 1 and 16 sessions of 512 and 2048 tokens (the CPU backend's choice)

No weights can be downloaded here: the model is a random-weight DeepSeek-V2 made by transformers with
V2-Lite's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim
128, its YaRN settings) and a smaller hidden size, layer and expert count (flags), saved once into
--folder with the bundled tokenizer. The perplexity of a random model is near its vocabulary's size and
says nothing about quality: here it only measures numerical fidelity, how far each storage moves it.

    python bench/mla.py                                   # every part, float32, 2 threads
    python bench/mla.py --part decode --sessions 1,16 --tokens 64 --context 1024
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.passive_omp()  # as the daemon does, before torch starts

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

PARTS = ("bytes", "ppl", "decode", "kernels")
KV_DTYPES = ("auto", "int8", "fp8", "int4")


def make_folder(args) -> Path:
    """The random-weight model folder for these flags (made once; the flags name it)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from streamchat.model.loader import resolve

    name = f"dsv2-lite-attn-h{args.hidden}-l{args.layers}-e{args.experts}"
    folder = Path(args.folder) / name
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=49152, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden, num_hidden_layers=args.layers, first_k_dense_replace=1,
        n_routed_experts=args.experts, num_experts_per_tok=min(6, args.experts), n_shared_experts=2,
        num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840, initializer_range=0.02, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "beta_fast": 32, "beta_slow": 1})
    DeepseekV2ForCausalLM(config).save_pretrained(folder)
    tokenizer = resolve(None).folder  # the bundled model's tokenizer and chat template
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder


def bytes_part(loaded, kv_dtypes) -> dict:
    """Bytes per token and layer: the latent row against full heads, at each storage."""
    from streamchat.kernels import quant
    from streamchat.model.kv_spec import MLAAttentionSpec

    a, dtype = loaded.model.shape.attention, loaded.model.dtype
    key_dim, heads = a.qk_nope_head_dim + a.qk_rope_head_dim, a.num_heads
    print(f"\nbytes per token and layer ({dtype}; full heads: {heads} x ({key_dim} key + {a.v_head_dim} value))")
    print(f"{'kv_dtype':<10}{'MLA latent':>12}{'full heads':>12}{'ratio':>8}")
    out = {}
    for kv in kv_dtypes:
        mla = MLAAttentionSpec(16, a.kv_lora_rank, a.qk_rope_head_dim, dtype, kv).bytes_per_token
        # keys and values of their own widths, each at this storage (quant.py's count, halved: K or V alone)
        full = sum(quant.bytes_per_token(kv, dtype, 1, heads, d, 16) for d in (key_dim, a.v_head_dim)) // 2
        out[kv] = {"mla": mla, "full_heads": full, "ratio": full / mla}
        print(f"{kv:<10}{mla:>12}{full:>12}{full / mla:>8.2f}")
    return out


def logits_of(loaded, kv_dtype: str, ids: list[int], prompt: int):
    """Logits of ids: the first `prompt` in one prefill, the rest decoded one at a time."""
    import torch

    from streamchat.cache.block_pool import BlockPool
    from streamchat.cache.manager import KVCacheManager
    from streamchat.config import CacheConfig
    from streamchat.model.batch import SeqChunk, StepBatch
    from streamchat.model.runner import ModelRunner

    num_blocks = len(ids) // 16 + 4
    runner = ModelRunner(loaded, CacheConfig(block_size=16, num_blocks=num_blocks, kv_dtype=kv_dtype))
    mgr = KVCacheManager(BlockPool(num_blocks), 16, 16, 1 << 20, prefix_sharing=False)
    seq, out = mgr.new_seq(), []
    for piece in [ids[:prompt]] + [[t] for t in ids[prompt:]]:
        placed = mgr.append(seq, piece)
        c = SeqChunk(piece, placed.positions, placed.slots, list(seq.block_ids), True)
        batch = StepBatch(prefill=[c]) if len(piece) > 1 else StepBatch(decode=[c])
        x, pos, meta, _ = runner.prepare(batch)
        out.append(loaded.model.forward(x, pos, meta, runner.kv_caches, torch.arange(len(piece))))
    return torch.cat(out)


def ppl_part(loaded, kv_dtypes, args) -> dict:
    """Perplexity per KV dtype and policy (streamchat eval), and the logits' distance from the float pool."""
    from streamchat.evaluate import evaluate
    from streamchat.evaluate_policies import EvalSpec

    ids = common.botchan_ids(loaded.tokenizer, args.eval_tokens)
    spec = EvalSpec(4, args.window, 16, h2o_recent_tokens=0)
    print(f"\nperplexity over {len(ids)} tokens of Botchan (random weights: a numerical-fidelity measure only)")
    print(f"{'kv_dtype':<10}{'policy':<8}{'ppl':>12}{'vs auto':>10}{'|dlogit|/std':>14}{'top-1 same':>12}")
    out, base = {}, {}
    reference = logits_of(loaded, "auto", ids[:args.fidelity_tokens], args.fidelity_tokens // 2)
    for kv in kv_dtypes:
        logits = reference if kv == "auto" else logits_of(loaded, kv, ids[:args.fidelity_tokens],
                                                          args.fidelity_tokens // 2)
        dist = float((logits - reference).abs().mean() / reference.std())
        same = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        for r in evaluate(loaded, ids, spec, ["full", "sink"], [kv]):
            base.setdefault(r.policy, r.ppl)
            change = 100 * (r.ppl / base[r.policy] - 1)
            out[f"{kv}/{r.policy}"] = {"ppl": r.ppl, "change_pct": change, "logit_dist": dist, "top1_same": same}
            print(f"{kv:<10}{r.policy:<8}{r.ppl:>12.1f}{change:>+9.2f}%{dist:>14.4f}{same:>12.3f}")
    return out


def decode_rate(llm, num_sessions: int, context: int, tokens: int) -> float:
    """Decode tokens/s of num_sessions responses of `tokens` each after a ~context-token user item."""
    from streamchat.engine.events import ResponseFinished
    from streamchat.model.sampling import SamplingParams

    eng = llm.engine
    sids = [f"s{num_sessions}-{i}" for i in range(num_sessions)]
    text = common.botchan_ids(llm.tokenizer, context * (num_sessions + 1))
    for i, sid in enumerate(sids):  # each its own slice of the text: no prefix shared
        eng.open_session(sid)
        eng.add_item(sid, "user", llm.tokenizer.decode(text[i * context:(i + 1) * context]))
        eng.start_response(sid, f"r-{sid}", SamplingParams(), max_tokens=tokens)
    while not all(eng.sessions[s].response.output_ids for s in sids):  # prefill, and every first token
        eng.step()
    before = sum(len(eng.sessions[s].response.output_ids) for s in sids)
    started, total = time.perf_counter(), 0
    while eng.has_work():
        total += sum(len(ev.token_ids) for ev in eng.step() if isinstance(ev, ResponseFinished))
    rate = (total - before) / (time.perf_counter() - started)
    for sid in sids:
        eng.close_session(sid)
    return rate


def decode_part(folder: Path, args) -> dict:
    from streamchat.config import CacheConfig, Config, ModelConfig, SchedulerConfig
    from streamchat.llm import LLM

    print(f"\ndecode tokens/s (engine, EOS off, {args.tokens} tokens after a ~{args.context}-token item)")
    print(f"{'backend':<10}{'kv_dtype':<10}" + "".join(f"{f'{n} sess.':>12}" for n in args.sessions))
    out = {}
    for backend in args.backends:
        for kv in args.decode_kv_dtypes:
            cfg = Config(model=ModelConfig(path=str(folder), dtype=args.dtype, attention_backend=backend,
                                           num_threads=args.threads),
                         cache=CacheConfig(kv_dtype=kv, window_tokens=max(2048, 2 * args.context),
                                           kv_memory_gib=1.0),
                         scheduler=SchedulerConfig(max_tokens_per_step=1024))
            llm = LLM(cfg)
            common.disable_eos(llm.engine)
            decode_rate(llm, 1, 32, 4)  # warm-up
            rates = [decode_rate(llm, n, args.context, args.tokens) for n in args.sessions]
            out[f"{backend}/{kv}"] = dict(zip(map(str, args.sessions), rates))
            print(f"{backend:<10}{kv:<10}" + "".join(f"{r:>12.2f}" for r in rates))
    return out


def kernels_part(args) -> dict:
    """p25 ms of one layer's decode attention: the torch reference and the C kernel, interleaved."""
    import torch

    from streamchat.kernels import cpu_mla, mla_reference, reference

    print("\nMLA decode attention, one layer (16 heads x (512 + 64), blocks of 16, float32), p25 ms")
    print(f"{'sessions':>8}{'tokens':>8}{'reference':>12}{'C kernel':>12}{'speed-up':>10}")
    g, out = torch.Generator().manual_seed(0), {}
    heads, c_dim, r_dim, bs = 16, 512, 64, 16
    for num_seqs, ctx in ((1, 512), (1, 2048), (16, 512), (16, 2048)):
        nb = -(-ctx // bs)
        cache = torch.randn(num_seqs * nb + 200, bs, c_dim + r_dim, generator=g)
        tables = (torch.randperm(cache.shape[0] - 1, generator=g)[:num_seqs * nb] + 1).view(num_seqs, nb)
        tables, lens = tables.to(torch.int32).contiguous(), torch.full((num_seqs,), ctx, dtype=torch.int32)
        cos, sin = torch.randn(ctx + bs, r_dim), torch.randn(ctx + bs, r_dim)
        q = torch.randn(num_seqs, heads, c_dim + r_dim, generator=g)
        plan = reference.decode_plan(tables, lens, bs, heads, 1, cos, sin, torch.float32, reference.Workspace())
        partial = torch.empty(cpu_mla.scratch_sizes(num_seqs, heads, c_dim, nb, bs)[0])
        calls = (lambda: mla_reference.decode(q, cache, plan, 0.1),
                 lambda: cpu_mla.paged_mla_decode(q, cache, tables, lens, cos, sin, 0.1, partial=partial))
        times = [[], []]
        for _ in range(args.reps):
            for i, call in enumerate(calls):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
        ref, kernel = (common.percentile(t, 25) * 1000 for t in times)
        out[f"{num_seqs}x{ctx}"] = {"reference_ms": ref, "c_kernel_ms": kernel}
        print(f"{num_seqs:>8}{ctx:>8}{ref:>12.2f}{kernel:>12.2f}{ref / kernel:>9.2f}x")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--folder", default="/tmp/streamchat-bench-mla", help="where the random model is saved")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="layers (the first dense, the rest mixture-of-experts)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=list(KV_DTYPES))
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256, help="the sink policy's window")
    ap.add_argument("--fidelity-tokens", type=int, default=128)
    ap.add_argument("--sessions", type=common.int_list, default=[1, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--backends", type=lambda s: s.split(","), default=["cpu"])
    ap.add_argument("--decode-kv-dtypes", type=lambda s: s.split(","), default=["auto"])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    parts = args.part.split(",")
    import torch

    torch.set_num_threads(args.threads)
    result = {"bench": "mla", "threads": args.threads, "dtype": args.dtype}
    if "kernels" in parts:
        result["kernels"] = kernels_part(args)
    folder = make_folder(args) if set(parts) & {"bytes", "ppl", "decode"} else None
    if {"bytes", "ppl"} & set(parts):
        from streamchat.config import ModelConfig
        from streamchat.model.runner import load_model

        loaded = load_model(ModelConfig(path=str(folder), dtype=args.dtype, num_threads=args.threads))
        print(common.describe(loaded))
        if "bytes" in parts:
            result["bytes"] = bytes_part(loaded, args.kv_dtypes)
        if "ppl" in parts:
            result["ppl"] = ppl_part(loaded, args.kv_dtypes, args)
        del loaded
    if "decode" in parts:
        result["decode"] = decode_part(folder, args)
    print(json.dumps(common.rounded(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
