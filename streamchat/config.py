"""One frozen config of sub-configs, passed explicitly to whatever needs it.

This module owns the settings' shapes, defaults and validation. It reads no
environment and no flags: `streamchat.settings` fills a `Config` from flags,
`STREAMCHAT_*` variables and an optional TOML file, in one place.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import socket
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float", "int8", "fp8", "int4")  # float: the model's dtype; auto: see model/kv_auto.py
EVICTIONS = ("sink_window", "h2o")  # which block leaves a full window (see cache/manager.py)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
WEIGHTS = ("auto", "bf16", "int8", "int4")  # auto: measured once per model and device, then cached
DECODE_ACTIVATIONS = ("float32", "mixed", "int8")


class ConfigError(ValueError):
    """A setting is out of range or inconsistent; the message says which."""


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bf16 where the device has bf16 instructions
    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: str = "auto"  # auto: triton on cuda; cpu (C decode kernel) elsewhere, torch without cc
    num_threads: int = 0  # torch intra-op threads; 0: one per core
    bind_threads: bool = True  # CPU: the engine core's threads one to a CPU, when they are as many as its CPUs
    cache_dir: str | None = None  # converted checkpoints; None: XDG cache
    # How the linear layers' weights are served: "bf16" is dense in `dtype` (the
    # issue's name; float32 on CPUs without bf16), int8 per channel, int4 in
    # groups of 32 (a Q4_1 GGUF's own blocks), auto the fastest of them whose
    # perplexity is within 1% of dense (measured once, cached). See model/weights.py.
    weights: str = "bf16"
    # What a decode step's rows multiply grouped weights (a GGUF's blocks, int8, int4) with on CPU:
    # float32 (exact), int8 (x rounded to 8 bits per group of 32, integer dot products: faster, not
    # exact), or mixed (int8 into o, down and the head only; model/weights.py). Not the default: a decode
    # row's product would then differ with the step it is in (a chunk of more rows than the groups serve
    # multiplies the dense weights in float32), so a reply batched with a prefill would not equal it alone.
    decode_activations: str = "float32"
    cuda_graphs: bool = True  # CUDA + Triton attention: decode steps replayed as CUDA graphs; ignored elsewhere

    def validate(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("weights", self.weights, WEIGHTS)
        _choice("decode_activations", self.decode_activations, DECODE_ACTIVATIONS)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.num_threads < 0:
            raise ConfigError(f"num_threads must be >= 0, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the sink + window policy."""

    block_size: int = 16
    num_blocks: int = 0  # 0: size from kv_memory_gib
    kv_memory_gib: float = 0.0  # pool size when num_blocks is 0; 0: auto (`auto_kv_bytes`)
    sink_tokens: int = 4  # rounded up to whole blocks
    window_tokens: int = 2048  # rounded up to whole blocks
    pin_system_prompt: bool = True  # the system prompt joins the sinks
    max_instructions_tokens: int = 1024  # a system prompt (framed) longer than this is refused
    prefix_sharing: bool = True
    # float (the model's dtype), int8, fp8, int4, or auto: measured once per model (model/kv_auto.py).
    # auto by default: for the bundled model on a 2-core CPU int8 measured perplexity -0.16% and step
    # -7.6% against float, within both bounds, at a quarter of the bytes.
    kv_dtype: str = "auto"
    # Each session's eviction policy (the default for every session): sink_window evicts the
    # oldest block after the sinks; h2o the block with the least attention mass outside the
    # sinks, the pinned system prompt and the last `h2o_recent_tokens` (rounded up to blocks).
    # A block's score is the attention mass it drew, summed over heads and layers (each query
    # token adds 1 in all), older mass multiplied by `h2o_decay` per query token (1: plain sum).
    eviction: str = "sink_window"
    h2o_recent_tokens: int = 256
    h2o_decay: float = 1.0

    def validate(self) -> None:
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        _positive("sink_tokens", self.sink_tokens)
        _positive("window_tokens", self.window_tokens)
        _positive("max_instructions_tokens", self.max_instructions_tokens)
        if self.window_tokens < 2 * self.block_size:
            raise ConfigError(
                f"window_tokens ({self.window_tokens}) must hold at least two blocks "
                f"of {self.block_size} tokens"
            )
        if self.num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.kv_memory_gib < 0:
            raise ConfigError(f"kv_memory_gib must be >= 0 (0: auto), got {self.kv_memory_gib}")
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("eviction", self.eviction, EVICTIONS)
        if self.h2o_recent_tokens < 0 or (self.eviction == "h2o" and
                                          self.h2o_recent_tokens > self.window_tokens - 2 * self.block_size):
            raise ConfigError(f"h2o_recent_tokens must be in [0, window_tokens - 2 * block_size] "
                              f"(= {self.window_tokens - 2 * self.block_size}), got {self.h2o_recent_tokens}")
        if isinstance(self.h2o_decay, bool) or not 0 < self.h2o_decay <= 1:
            raise ConfigError(f"h2o_decay must be in (0, 1], got {self.h2o_decay!r}")

    @property
    def num_sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def num_window_blocks(self) -> int:
        return -(-self.window_tokens // self.block_size)

    def max_blocks_per_session(self, pinned_tokens: int = 0) -> int:
        """Blocks a session may hold: its sink region plus a full window plus one."""
        sink = max(self.sink_tokens, pinned_tokens if self.pin_system_prompt else 0)
        return -(-sink // self.block_size) + self.num_window_blocks + 1


@dataclass(frozen=True)
class SchedulerConfig:
    """How the engine builds each step's batch."""

    max_tokens_per_step: int = 256  # decode tokens + prefill chunk tokens
    # While any session streams, a step aims at `target_step_ms` (the streams' inter-token
    # target): decode goes first, prefill gets the rest of the step, shared fairly among the
    # sessions with queued tokens, by a cost model the scheduler learns from the steps it runs.
    # When decode alone passes the target, prefill still gets `min_prefill_share` of it, so a
    # crowd of streams never starves the sessions still prefilling.
    target_step_ms: float = 200.0
    min_prefill_share: float = 0.25
    max_running: int = 64  # sessions generating at once
    queue_timeout_s: float = 60.0  # no progress for this long before the first token: `overloaded`
    # work a client may queue before it is in the cache: past it, `pending_limit_exceeded`
    # (one session) or `overloaded` (the whole daemon)
    max_pending_tokens_per_session: int = 65_536
    max_pending_tokens: int = 1_048_576
    max_failed_steps: int = 5  # engine steps failing in a row before the engine core gives up (restarted)
    engine_call_timeout_s: float = 30.0  # a command not taken by the engine by then: `engine_unavailable`
    # the engine core is restarted when it dies; this many deaths within the window: the daemon exits 1
    max_engine_restarts: int = 5
    engine_restart_window_s: float = 300.0

    def validate(self) -> None:
        _positive("max_tokens_per_step", self.max_tokens_per_step)
        _positive("max_running", self.max_running)
        if isinstance(self.min_prefill_share, bool) or not 0 <= self.min_prefill_share <= 10:
            raise ConfigError(f"min_prefill_share must be in [0, 10], got {self.min_prefill_share!r}")
        _positive("max_pending_tokens_per_session", self.max_pending_tokens_per_session)
        _positive("max_pending_tokens", self.max_pending_tokens)
        _positive("max_failed_steps", self.max_failed_steps)
        if isinstance(self.max_engine_restarts, bool) or not isinstance(self.max_engine_restarts, int) \
                or self.max_engine_restarts < 0:
            raise ConfigError(f"max_engine_restarts must be an integer >= 0, got {self.max_engine_restarts!r}")
        for name in ("queue_timeout_s", "engine_call_timeout_s", "target_step_ms", "engine_restart_window_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The websocket daemon and its limits."""

    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None
    # Browsers' Origin header. Empty: no Origin (non-browser clients) or the
    # daemon's own http://{127.0.0.1,localhost,[::1],host}:port; "*": any (unsafe).
    allowed_origins: tuple[str, ...] = ()
    # Host header names (no port) accepted besides loopback ones while bound to
    # a loopback address: the guard against DNS rebinding.
    allowed_hosts: tuple[str, ...] = ()
    # Names a client may give as `model` (as vLLM's --served-model-name); empty: the
    # model's own name. "*" among them accepts any name (this daemon serves one model).
    served_model_name: tuple[str, ...] = ()
    max_frame_bytes: int = 1 << 20
    max_text_chars: int = 200_000  # one item or append
    max_output_tokens: int = 4096
    max_sessions_per_connection: int = 16
    max_connections: int = 512
    send_queue_events: int = 256
    max_append_item_chars: int = 4_000_000  # all appends of one open item -> message_too_large
    session_idle_release_s: float = 300.0  # no connection for this long: the session leaves memory
    shutdown_timeout_s: float = 10.0  # SIGTERM to exit, whatever is still running
    send_timeout_s: float = 30.0  # a client that reads nothing for this long is dropped
    send_buffer_bytes: int = 65536  # per connection, bytes waiting in the daemon and (doubled) in the kernel
    head_timeout_s: float = 10.0  # a request head (a handshake too) must arrive within this: else 408
    body_timeout_s: float = 30.0  # a request body must arrive within this once its head did: else 408
    metrics_public: bool = False  # /metrics without the API key even when one is set
    # permessage-deflate on websockets, when a client offers it. Off: a reply's frames are a few
    # hundred bytes of JSON each, and deflating them cost the front and its clients CPU that the
    # engine's step threads share (a handshake 2.2-2.7 -> 1.3-1.5 ms of the front's CPU off).
    ws_compression: bool = False

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        for name in self.served_model_name:
            if not name.strip() or name != name.strip():
                raise ConfigError(f"served_model_name: {name!r} is not a model name (empty or padded)")
        if len(set(self.served_model_name)) != len(self.served_model_name):
            raise ConfigError(f"served_model_name names one model twice: {list(self.served_model_name)}")
        for name in ("max_frame_bytes", "max_text_chars", "max_output_tokens",
                     "max_sessions_per_connection", "max_connections", "send_queue_events",
                     "max_append_item_chars", "send_buffer_bytes"):
            _positive(name, getattr(self, name))
        for name in ("session_idle_release_s", "shutdown_timeout_s", "send_timeout_s", "head_timeout_s",
                     "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Where sessions and transcripts are kept."""

    url: str = "sqlite:///streamchat.db"


@dataclass(frozen=True)
class TierConfig:
    """Where idle sessions' KV goes below the device pool: host memory, then disk."""

    host_tier_gib: float = 1.0  # host memory for idle sessions' blocks (pinned on CUDA); 0: off
    disk_tier_gib: float = 10.0  # budget of the data directory, oldest-used files deleted; 0: off
    data_dir: str | None = None  # None: next to the SQLite file, else $XDG_DATA_HOME/streamchat/kv
    checkpoint_idle_s: float = 60.0  # idle this long: a copy goes to disk (kill -9 safety); 0: off

    def validate(self) -> None:
        for name in ("host_tier_gib", "disk_tier_gib", "checkpoint_idle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.data_dir is not None and not self.data_dir.strip():
            raise ConfigError("data_dir must not be empty (leave it unset for the default)")

    @property
    def host_bytes(self) -> int:
        return int(self.host_tier_gib * (1 << 30))

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_tier_gib * (1 << 30))


# A daemon id names a lease's owner and labels logs and metrics: letters, digits and ._:- only.
DAEMON_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def new_daemon_id() -> str:
    """`host-xxxxxx`: this machine's name (trimmed to what DAEMON_ID_PATTERN allows) and 24 random bits."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48] or "daemon"
    return f"{host}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class FleetConfig:
    """This daemon's place in a fleet: its id, how long its session leases last, how often it says it is alive."""

    daemon_id: str = field(default_factory=new_daemon_id)  # default: generated anew at every start
    lease_s: float = 15.0  # a session whose daemon stopped renewing is taken over after this long
    heartbeat_s: float = 5.0  # registry heartbeat and lease renewal interval

    def validate(self) -> None:
        if not DAEMON_ID_PATTERN.fullmatch(self.daemon_id):
            raise ConfigError(f"daemon_id must be 1 to 64 of A-Z a-z 0-9 . _ : -, got {self.daemon_id!r}")
        for name in ("lease_s", "heartbeat_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.heartbeat_s > self.lease_s / 2:
            # One late heartbeat must not cost every lease: at least two renewals per lease.
            raise ConfigError(f"heartbeat_s ({self.heartbeat_s}) must be at most half of lease_s ({self.lease_s})")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)

    def validate(self) -> "Config":
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.server.validate()
        self.tiers.validate()
        self.fleet.validate()
        if self.scheduler.max_tokens_per_step < self.cache.block_size:
            raise ConfigError("max_tokens_per_step must be at least one block")
        return self

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


# How torch's OpenMP workers wait between parallel regions; set before torch starts (libgomp reads
# them when it loads), an environment that already sets them wins. PASSIVE alone puts a worker to
# sleep after every region, and a decode step opens about eight per layer: for one session each
# wake-up through the kernel cost more than the region's work on the 2-core VM this was measured
# on (single-session decode 10.8-16.1 tok/s passive against 18.9-22.6 with the spin, four
# interleaved pairs). A bounded spin (libgomp counts about 100,000 a millisecond, so ~0.3 ms)
# keeps the worker awake across one step's regions and lets it sleep between steps, where the
# event loop thread needs the core; spinning without a bound (the default policy) starves it.
OMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}


def omp_wait_defaults() -> None:
    """Set OMP_WAIT (each unless already set); call before torch is imported."""
    for name, value in OMP_WAIT.items():
        os.environ.setdefault(name, value)


def freeze_startup_heap() -> int:
    """Collect once, then keep every object alive now out of the cyclic collector's passes
    (`gc.freeze`); returns how many were frozen. Call when a process has started (model, tokenizer,
    libraries loaded). A full collection walks every tracked object: in the engine core, with the
    model and its libraries loaded, one took 142-156 ms on the thread that runs the steps (a gap
    of that size in every stream) and came every few minutes of serving; after the freeze it walks
    only what was made since. Objects frozen here live as long as the process anyway."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
