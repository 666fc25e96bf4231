"""`--kv-dtype auto`: the smallest KV storage whose perplexity and step time stay near float's.

Owns the decision and its cache. A storage qualifies when its perplexity
on the shipped text is within PPL_TOLERANCE of the float pool's and its
decode step on the long-chat workload (sessions with a full window) is at
most STEP_TOLERANCE slower; the qualifying one with the fewest bytes per
token wins (fp8 after int8 at equal bytes: the lower perplexity first).
The float pool always qualifies. The measuring is the caller's `measure`
(`streamchat.autotune.measure_kv_dtypes`); the decision is a small JSON
file per (served model fingerprint, device, dtype, attention backend)
beside the converted models (`$XDG_CACHE_HOME/streamchat/models/kv-auto/`),
so later starts read it; delete it to measure again.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from streamchat.model.weights_auto import write_decision

log = logging.getLogger(__name__)

CANDIDATES = ("float", "int8", "fp8", "int4")  # what auto chooses from ("float": the model's own dtype)
PPL_TOLERANCE = 0.005
STEP_TOLERANCE = 0.05


@dataclass(frozen=True)
class KvMeasured:
    ppl: float
    step_ms: float | None  # fastest decode step of the long-chat workload; None: not timed (perplexity past)
    bytes_per_token: int


class KvChoice(NamedTuple):
    kv_dtype: str
    reason: str  # what /healthz and the start-up log say


def pick(measured: dict[str, KvMeasured]) -> KvChoice:
    """The fewest bytes per token within both bounds of "float" (which `measured` must hold)."""
    base = measured["float"]

    def costs(name: str) -> str:
        m = measured[name]
        step = "not timed" if m.step_ms is None else f"{m.step_ms / base.step_ms - 1:+.1%}"
        return (f"perplexity {m.ppl / base.ppl - 1:+.2%}, step {step}, "
                f"{m.bytes_per_token / base.bytes_per_token:.0%} of the bytes")

    def fits(name: str) -> bool:
        m = measured[name]
        return (m.ppl <= base.ppl * (1 + PPL_TOLERANCE) and m.step_ms is not None
                and m.step_ms <= base.step_ms * (1 + STEP_TOLERANCE))

    order = sorted(measured, key=lambda n: (measured[n].bytes_per_token, measured[n].ppl))
    choice = next(name for name in order if name == "float" or fits(name))
    others = [f"{n} ({costs(n)})" for n in order if n not in (choice, "float")]
    bounds = f"perplexity +{PPL_TOLERANCE:.1%} and step +{STEP_TOLERANCE:.0%} of float's"
    head = (f"{choice}, the fewest bytes within {bounds}: {costs(choice)}" if choice != "float"
            else f"float: no smaller storage within {bounds}")
    return KvChoice(choice, f"auto chose {head}" + (f"; also measured {', '.join(others)}" if others else ""))


def decision_path(cache_dir: Path, fingerprint: str, device: str, dtype: str, backend: str) -> Path:
    return cache_dir / "kv-auto" / f"{fingerprint}-{device}-{dtype}-{backend}.json"


def read_decision(path: Path) -> KvChoice | None:
    """A cached choice, or None when absent or unreadable (then auto measures again)."""
    try:
        record = json.loads(path.read_text())
        choice = KvChoice(record["choice"], record["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if choice.kv_dtype in CANDIDATES and isinstance(choice.reason, str) else None


def choose(path: Path, measure: Callable[[], dict[str, KvMeasured]]) -> KvChoice:
    """The cached decision at `path`, else `measure()` once, decide, cache and log."""
    cached = read_decision(path)
    if cached is not None:
        return KvChoice(cached.kv_dtype, f"{cached.reason} (measured earlier: {path})")
    started = time.perf_counter()
    measured = measure()
    choice = pick(measured)
    write_decision(path, {"choice": choice.kv_dtype, "reason": choice.reason, "ppl_tolerance": PPL_TOLERANCE,
                          "step_tolerance": STEP_TOLERANCE,
                          "measured": {k: asdict(m) for k, m in measured.items()}})
    log.info("kv dtype auto measured in %.0f s; cached in %s", time.perf_counter() - started, path)
    return choice
