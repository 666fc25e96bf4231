"""Filling a Config from flags, `STREAMCHAT_*` environment variables and a TOML file.

The one place that reads the environment and the command line for settings.
Precedence: flag > environment > TOML file > default. Every field of every
section gets a flag `--field-name` and a variable `STREAMCHAT_FIELD_NAME`
(a few read better renamed: see ALIASES). Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
import typing

from streamchat.config import (CacheConfig, Config, ConfigError, FleetConfig, ModelConfig, SchedulerConfig,
                               ServerConfig, StoreConfig, TierConfig)

SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "server": ServerConfig, "store": StoreConfig, "tiers": TierConfig, "fleet": FleetConfig}
ALIASES = {("model", "path"): "model", ("store", "url"): "database_url"}
HELP = {
    "model": "model folder (Hugging Face, safetensors) or .gguf file; default: bundled SmolLM2-135M-Instruct",
    "dtype": "model dtype: auto (bf16 where the CPU/GPU has it), float32, bfloat16, float16",
    "weights": "weight format: bf16 (dense in --dtype; on CPU a GGUF's own blocks serve a decode step of up to 32 rows in float32, 3 in bfloat16), "
               "int8 (per channel), int4 (groups of 32; a Q4_1 GGUF's own blocks), auto (the fastest within 1%% perplexity of dense, measured once and cached); "
               "int8/int4 run on CPU only",
    "kv_dtype": "KV pool storage: float (the model's dtype), int8 or fp8 (a float32 scale per token per KV head), "
                "int4, or auto (the fewest bytes whose perplexity is within 0.5%% of float's and whose step is "
                "within 5%%, measured once per model and cached; /healthz says what it chose and why)",
    "decode_activations": "what a decode step's rows multiply grouped weights (a GGUF's blocks, int8, int4) with "
                          "on CPU: float32 (exact), int8 (rounded to 8 bits per group of 32, integer products: "
                          "faster, not exact), or mixed (int8 into o, down and the head only: between the two)",
    "attention_backend": "auto (triton on CUDA; cpu, the C decode kernel, elsewhere; torch without a C compiler), "
                         "cpu, torch (the pure-torch reference) or triton",
    "cuda_graphs": "replay decode steps as one CUDA graph per batch-size bucket (CUDA with Triton attention "
                   "only; ignored elsewhere); false: launch every kernel eagerly",
    "bind_threads": "on CPU, bind the engine core's decode threads one to a CPU when they are as many as the "
                    "CPUs it may use (Linux), so that other work on the machine delays a step less; false: the "
                    "scheduler places them",
    "database_url": "SQLAlchemy URL of the session store",
    "allowed_origins": "comma-separated Origin allow-list; empty: no Origin or the daemon's own; '*': any (unsafe)",
    "allowed_hosts": "comma-separated Host names accepted besides loopback ones when bound to loopback",
    "served_model_name": "a name clients may give as `model` (repeatable or comma-separated; default: the "
                         "model's own name; '*': accept any name)",
    "api_key": "require `Authorization: Bearer KEY` on the websocket handshake, the HTTP API and /metrics",
    "metrics_public": "serve /metrics without the API key (a bare --metrics-public is true)",
    "ws_compression": "accept permessage-deflate on websockets when the client offers it (a bare "
                      "--ws-compression is true; off by default: frames are small and deflating costs CPU)",
    "send_timeout_s": "a websocket or HTTP client that reads nothing for this long is disconnected, its "
                      "response cancelled (its session stays resumable)",
    "send_buffer_bytes": "bytes one connection may have waiting to be sent, in the daemon and (doubled by "
                         "Linux) in the kernel's socket buffer; beyond them a send waits, up to --send-timeout-s",
    "head_timeout_s": "a request head or websocket handshake must arrive within this (else 408)",
    "body_timeout_s": "a request body must arrive within this once its head has (else 408)",
    "num_blocks": "KV pool blocks (0: size the pool from --kv-memory-gib)",
    "kv_memory_gib": "KV pool size when --num-blocks is 0 (0: an eighth of the machine's memory, or of the "
                     "GPU's, at least 1 GiB)",
    "host_tier_gib": "host memory for idle sessions' KV blocks (pinned on CUDA; 0: off)",
    "disk_tier_gib": "size budget of the data directory of saved sessions, least recently used deleted first (0: off)",
    "data_dir": "where saved sessions go (default: next to the SQLite file, else $XDG_DATA_HOME/streamchat/kv)",
    "max_instructions_tokens": "tokens a system prompt (session instructions, a turn's instructions, an HTTP "
                               "request's system messages), framed, may have; longer ones are refused "
                               "instructions_too_long",
    "max_pending_tokens_per_session": "tokens one session may have queued before they are in the cache",
    "max_pending_tokens": "tokens all sessions together may have queued (past it: overloaded)",
    "max_failed_steps": "engine steps failing in a row before the engine core gives up (and is restarted)",
    "max_engine_restarts": "engine core deaths within --engine-restart-window-s before /healthz says 503 and "
                           "the daemon exits 1 (0: the first death)",
    "engine_restart_window_s": "the window over which engine core deaths are counted",
    "engine_call_timeout_s": "a request the engine has not taken by then fails engine_unavailable",
    "max_append_item_chars": "characters one open append item may collect (past it: message_too_large)",
    "session_idle_release_s": "a session with no connection for this long leaves memory (to disk / transcript)",
    "shutdown_timeout_s": "SIGTERM: end responses, save, close and exit within this many seconds",
    "checkpoint_idle_s": "a session idle this long is also saved to disk, so kill -9 loses no KV (0: off)",
    "daemon_id": "this daemon's name in the fleet (lease owner, logs, metrics); unique among running daemons",
    "lease_s": "a session's lease lasts this long unless renewed; another daemon takes over a dead one's after it",
    "heartbeat_s": "how often the daemon tells the registry it is alive and renews its leases (at most lease_s / 2)",
}


def _flag_name(section: str, name: str) -> str:
    return ALIASES.get((section, name), name)


def _field_type(cls, f: dataclasses.Field):
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:  # X | None
        return next(a for a in typing.get_args(t) if a is not type(None))
    return t


def _convert(value, typ, name: str):
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typing.get_origin(typ) is tuple or typ is tuple:
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v]
            return tuple(str(v).strip() for v in items)
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None


def add_flags(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS),
              skip: tuple[str, ...] = ()) -> None:
    """One flag per setting of the given sections (not those in `skip`), plus --config FILE."""
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings ([model], [cache], ...)")
    for section in sections:
        group = parser.add_argument_group(f"{section} settings")
        for f in dataclasses.fields(SECTIONS[section]):
            flag = _flag_name(section, f.name)
            if flag in skip:
                continue
            typ = _field_type(SECTIONS[section], f)
            many = typing.get_origin(typ) is tuple  # repeatable, or a, b, c
            switch = {"nargs": "?", "const": "true"} if typ is bool else {}  # a bare --flag says true
            group.add_argument("--" + flag.replace("_", "-"), dest=f"{section}.{f.name}", default=None, **switch,
                               action="append" if many else "store", metavar=flag.split("_")[-1].upper(),
                               help=f"{HELP.get(flag, '')} (env STREAMCHAT_{flag.upper()}; default {_default(f)})")


def _default(f: dataclasses.Field) -> str:
    return "generated at start" if f.default is dataclasses.MISSING else repr(f.default)


def load(args: argparse.Namespace | None = None, environ: typing.Mapping[str, str] | None = None) -> Config:
    """The validated Config: flags over environment over TOML over defaults."""
    environ = os.environ if environ is None else environ
    flags = vars(args) if args is not None else {}
    path = flags.get("config") or environ.get("STREAMCHAT_CONFIG")
    toml = _read_toml(path) if path else {}
    built = {}
    for section, cls in SECTIONS.items():
        values = {}
        for f in dataclasses.fields(cls):
            flag = _flag_name(section, f.name)
            raw = flags.get(f"{section}.{f.name}")
            if isinstance(raw, list):  # a repeated flag: each may hold a comma-separated list too
                raw = ",".join(raw)
            if raw is None:
                raw = environ.get(f"STREAMCHAT_{flag.upper()}")
            if raw is None:
                raw = toml.get(section, {}).get(f.name)
            if raw is not None:
                values[f.name] = _convert(raw, _field_type(cls, f), "--" + flag.replace("_", "-"))
        built[section] = cls(**values)
    return Config(**built).validate()


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return data
