"""Sampling parameters: what each may be, where defaults come from, and which setting wins.

Owns `SamplingParams` and its admitted ranges, the defaults a model serves
with (its `generation_config.json`, else `DEFAULT_PARAMS`, chosen with
`bench/replies.py`), and `resolve_params`, the one rule that merges model
defaults, session defaults and a response's own fields. Torch-free, so the
server, the CLI and their tests use it without loading torch;
`streamchat.model.sampling` applies the params to logits. `RULES` is the
one table of what each field admits: `validate()` checks params with it,
and both wires (the websocket's response.create and session.update, the
HTTP API's chat completions) read their sampling fields with `read_fields`,
which applies it and names the field at fault (`FieldError`).

Ranges, all refused with ValueError outside them (NaN, infinities and bools
included): temperature [0, 2], top_p (0, 1], top_k an int in [0, 2^63-1]
(0: off), seed None or an int in [-2^63, 2^63-1], frequency_penalty and
presence_penalty [-2, 2] (OpenAI's), repetition_penalty (0, 10] (1: off),
min_p [0, 1] (0: off), logit_bias at most 300 (token id, bias) pairs sorted
by id, each id an int >= 0 and each bias in [-100, 100] (OpenAI's), and
logprobs None or an int in [0, 20] (OpenAI's top_logprobs). Token ids at or
past the vocabulary are refused only by `validate(vocab_size)`: the params
know no model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

log = logging.getLogger(__name__)

TEMPERATURE_MAX = 2.0
# Below 1e-4 a logit gap of 0.01 already scales to a factor under e^-100
# (~4e-44, at the bottom of float32's subnormals): sampling would be argmax
# except among exact near-ties, so it is argmax, which is also deterministic.
# It also keeps 1/temperature a normal float32 (a float32 of 1e-300 is 0).
TEMPERATURE_FLOOR = 1e-4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Signed 64 bits, so a seed fits an int64 anywhere it is kept. manual_seed
# also takes [2^63, 2^64), but those alias the negative seeds. The CPU
# generator (mt19937) keeps only the low 32 bits: seeds equal modulo 2^32
# draw the same tokens.
SEED_MIN, SEED_MAX = INT64_MIN, INT64_MAX
TOP_K_MAX = INT64_MAX  # fits an int64 tensor or column; larger is pointless anyway
PENALTY_MAX = 2.0  # |frequency_penalty|, |presence_penalty|: OpenAI's range
REPETITION_PENALTY_MAX = 10.0  # 10 already divides a seen token's logit tenfold
# repetition_penalty looks at the last REPETITION_WINDOW tokens of context and
# reply: long enough to hold the loop a small model falls into (a sentence or
# two), short enough that the words of the question itself (the user's
# "cat") are not punished for the whole reply.
REPETITION_WINDOW = 64
LOGIT_BIAS_MAX = 100.0  # |bias|: OpenAI's range; -100 bans a token in effect, +100 forces it
LOGIT_BIAS_MAX_ENTRIES = 300  # OpenAI's limit on one request's map
TOP_LOGPROBS_MAX = 20  # OpenAI's top_logprobs range is [0, 20]
_TOKEN_ID = re.compile(r"[0-9]+")  # a JSON object's key naming a token id: ASCII digits only


@dataclass(frozen=True)
class SamplingParams:
    """How one response picks its tokens. The class defaults are plain greedy decoding.

    New fields go after `seed`, so positional callers keep their meaning.
    """

    temperature: float = 0.0  # below TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    frequency_penalty: float = 0.0  # logit -= f * count in the reply so far
    presence_penalty: float = 0.0  # logit -= p if in the reply so far
    repetition_penalty: float = 1.0  # seen in the last REPETITION_WINDOW tokens: logit / r if > 0, else * r
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0: off
    # (token id, bias) pairs, ids increasing: bias added to the raw logit before anything else
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: report no log-probabilities; k: the chosen token's and the k most likely tokens'
    logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Returns self, or raises ValueError for a value outside the admitted ranges.

        With `vocab_size`, also refuses a logit_bias id at or past it (the
        sampler itself ignores such ids).
        """
        for name in _CHECKED:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                RULES[name].check(name, value)
        _check_logit_bias(self.logit_bias, vocab_size)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def penalized(self) -> bool:
        """Whether the tokens already seen change the logits (greedy rows included)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


# The per-request fields of OpenAI's API: a response (or a session) sets them by
# name like the others, but no CLI flag or generation_config.json does.
REQUEST_FIELDS = ("logit_bias", "logprobs")
# The numeric knobs every front sets by name (CLI flags, session defaults,
# response fields); resolve_params takes these and REQUEST_FIELDS.
SAMPLING_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in REQUEST_FIELDS)

# The serving default when the model's folder says nothing (the bundled GGUF
# never does). Chosen with bench/replies.py on the bundled SmolLM2-135M-Instruct,
# 16 open prompts x 200 tokens (docs/bench.md): greedy loops in 7 of 16
# replies (distinct-2 0.56); temperature 0.7 and top_p 0.9 alone in 3; with
# repetition_penalty 1.1 in 0 of 16 (0 of 48 over three seeds), distinct-2 0.90.
DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)

# generation_config.json keys we read, all optional; HF's names and meanings.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


class FieldError(ValueError):
    """A sampling field's value is refused: `field` names it as the request spelled it, str() says why."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


@dataclass(frozen=True)
class Rule:
    """What one field admits: a finite number (int or float; an int alone if `integer`) in [low, high], or
    (low, high] if `low_open`. Bools are never numbers."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False

    def admits(self, value: object) -> bool:
        if not (_is_int(value) or (not self.integer and isinstance(value, float) and math.isfinite(value))):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high  # type: ignore

    def check(self, name: str, value: object) -> None:
        """FieldError naming `name` unless the value is admitted."""
        if not self.admits(value):
            kind = "an integer" if self.integer else "a number"
            interval = f"{'(' if self.low_open else '['}{_bound(self.low)}, {_bound(self.high)}]"
            raise FieldError(name, f"must be {kind} in {interval}, got {value!r}")

    def read(self, name: str, value: object) -> float | int:
        """An admitted value as params keep it: an int for an integer field, else a float (-0.0 as 0.0)."""
        self.check(name, value)
        return value if self.integer else float(value) + 0.0  # type: ignore[arg-type,return-value]


# The one table of admitted values, by SamplingParams name. The wires read `top_logprobs` with
# RULES["logprobs"], and each logit_bias value with RULES["logit_bias"].
RULES: Mapping[str, Rule] = MappingProxyType({
    "temperature": Rule(0.0, TEMPERATURE_MAX),
    "top_p": Rule(0.0, 1.0, low_open=True),
    "top_k": Rule(0, TOP_K_MAX, integer=True),
    "seed": Rule(SEED_MIN, SEED_MAX, integer=True),
    "frequency_penalty": Rule(-PENALTY_MAX, PENALTY_MAX),
    "presence_penalty": Rule(-PENALTY_MAX, PENALTY_MAX),
    "repetition_penalty": Rule(0.0, REPETITION_PENALTY_MAX, low_open=True),
    "min_p": Rule(0.0, 1.0),
    "logit_bias": Rule(-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX),
    "logprobs": Rule(0, TOP_LOGPROBS_MAX, integer=True),
})
_CHECKED = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "min_p", "logprobs")
_OPTIONAL = ("seed", "logprobs")  # None: unset
# The JSON names of the sampling fields a request may carry, each read by `read_fields`.
WIRE_FIELDS = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
               "repetition_penalty", "min_p", "logit_bias", "logprobs", "top_logprobs")


def _bound(value: float) -> str:
    return {INT64_MAX: "2^63-1", INT64_MIN: "-2^63"}.get(value, f"{value:g}")  # type: ignore[call-overload]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_fields(doc: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The sampling fields a request body sets among `names` (JSON names of WIRE_FIELDS), checked, by
    SamplingParams name. JSON null is unset. FieldError names the first field at fault.

    OpenAI's shapes: `logit_bias` an object of token id (a string of digits)
    to bias; `logprobs` a boolean, true to report the chosen tokens' log-
    probabilities, with `top_logprobs` (0..20, only with `logprobs: true`)
    alternatives each: the params' `logprobs` is that count.
    """
    fields: dict[str, Any] = {}
    for name in names:
        value = doc.get(name)
        if value is None or name in ("logprobs", "top_logprobs"):
            continue
        fields[name] = _logit_bias(value) if name == "logit_bias" else RULES[name].read(name, value)
    if "logprobs" in names:
        _logprobs(doc, fields)
    return fields


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, Mapping):
        raise FieldError("logit_bias", "must be an object of token ids to biases")
    try:
        pairs = logit_bias_pairs(value)
    except ValueError as exc:
        raise FieldError("logit_bias", str(exc).removeprefix("logit_bias ")) from None
    _check_logit_bias(pairs, None)
    return tuple((token, float(bias) + 0.0) for token, bias in pairs)


def _logprobs(doc: Mapping[str, Any], fields: dict[str, Any]) -> None:
    wanted, top = doc.get("logprobs"), doc.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise FieldError("logprobs", f"must be a boolean, got {wanted!r}")
    if top is not None:
        top = RULES["logprobs"].read("top_logprobs", top)
        if not wanted:
            raise FieldError("top_logprobs", "needs logprobs: true")
    if wanted:
        fields["logprobs"] = top or 0


def _check_logit_bias(pairs: object, vocab_size: int | None) -> None:
    """FieldError("logit_bias") unless `pairs` is a tuple of at most 300 (id, bias) pairs, ids increasing
    ints >= 0 (below `vocab_size` when given), biases admitted by RULES["logit_bias"]."""
    if not isinstance(pairs, tuple):
        raise FieldError("logit_bias", f"must be a tuple of (token id, bias) pairs (logit_bias_pairs() makes one "
                                       f"from a mapping), got {type(pairs).__name__}")
    if len(pairs) > LOGIT_BIAS_MAX_ENTRIES:
        raise FieldError("logit_bias", f"may name at most {LOGIT_BIAS_MAX_ENTRIES} tokens, got {len(pairs)}")
    previous = -1
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise FieldError("logit_bias", f"entries must be (token id, bias) pairs, got {pair!r}")
        token, bias = pair
        if not _is_int(token) or not previous < token <= INT64_MAX:
            raise FieldError("logit_bias", f"token ids must be increasing integers >= 0, got {token!r} after "
                                           f"{previous}")
        if vocab_size is not None and token >= vocab_size:
            raise FieldError("logit_bias", f"token id {token} is outside the vocabulary ({vocab_size} tokens)")
        if not RULES["logit_bias"].admits(bias):
            raise FieldError("logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {token}")
        previous = token


def logit_bias_pairs(mapping: Mapping[int | str, Any]) -> tuple[tuple[int, Any], ...]:
    """A logit_bias map as OpenAI's JSON sends it ({"50256": -100}; int keys too) -> SamplingParams' pairs.

    ValueError for a key that is not a token id (ASCII digits, or an int >= 0)
    or that names a token twice ("7" and "07"). The biases are checked by
    `validate()`.
    """
    pairs: dict[int, Any] = {}
    for key, bias in mapping.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token = int(key)
        elif _is_int(key) and key >= 0:
            token = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if token in pairs:
            raise ValueError(f"logit_bias names token {token} twice")
        pairs[token] = bias
    return tuple(sorted(pairs.items()))


def resolve_params(model_defaults: SamplingParams, session_defaults: Mapping[str, Any],
                   response_fields: Mapping[str, Any]) -> SamplingParams:
    """The params one response samples with: its own fields, else the session's, else the model's.

    Both mappings take SamplingParams field names; a None value means unset.
    A logit_bias given as a mapping (OpenAI's JSON object) becomes pairs, and
    replaces the lower layer's whole map. Returns validated params;
    ValueError for a value out of range, TypeError for a name that is not a
    sampling field (a caller's mistake).
    """
    merged: dict[str, Any] = {}
    for layer in (session_defaults, response_fields):
        unknown = set(layer) - set(SAMPLING_FIELDS) - set(REQUEST_FIELDS)
        if unknown:
            raise TypeError(f"not sampling fields: {', '.join(sorted(unknown))}")
        merged.update((k, v) for k, v in layer.items() if v is not None)
    if isinstance(merged.get("logit_bias"), Mapping):
        merged["logit_bias"] = logit_bias_pairs(merged["logit_bias"])
    return dataclasses.replace(model_defaults, **merged).validate()


def load_model_defaults(folder: Path) -> SamplingParams:
    """The params a model serves with when nobody asks otherwise.

    From the folder's generation_config.json when it sets any of temperature,
    top_p, top_k, repetition_penalty, min_p or do_sample: the keys it sets, HF's
    neutral values for the others (temperature 1 when it samples), and greedy
    when it says `"do_sample": false`. A key outside our range is skipped with
    a warning. No file, an unreadable one, or none of those keys:
    DEFAULT_PARAMS.
    """
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return DEFAULT_PARAMS
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return DEFAULT_PARAMS
    if not isinstance(config, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return DEFAULT_PARAMS
    values = {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}
    do_sample = config.get("do_sample")
    if not values and do_sample is None:
        return DEFAULT_PARAMS
    params = SamplingParams(temperature=1.0)
    for key, value in values.items():
        try:
            params = dataclasses.replace(params, **{key: value}).validate()
        except ValueError as exc:
            log.warning("%s: skipping %s", path, exc)
    if do_sample is False:
        params = dataclasses.replace(params, temperature=0.0)
    return params
