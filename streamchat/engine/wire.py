"""The messages between the front and the engine core, and their encoding.

Owns the envelope of every message on the two zmq sockets and how it is
encoded: msgpack through msgspec, which encodes the `engine.api` dataclasses
as they are and decodes them back into the same types, checked field by
field (a malformed message is an error, never a half-built command). Why
msgspec: typed, validated decoding of plain dataclasses at a few
microseconds a message, the same choice vLLM's engine core made.

    front -> core   [b"call", (command name, request id, deadline, command)]   one per command
                    [b"stop"]                                                  end after this
    core -> front   [b"ready", CoreInfo]                                       once, after start-up
                    [b"out", StepOutput]                                       one per loop iteration
                    [b"beat"]                                                  when idle for a while
                    [b"fatal", (kind, reason)]                                 the core cannot go on

A deadline is `time.monotonic()` of the front (the same clock in every
process on one machine): a command the core takes after it is refused
`engine_unavailable` and never runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamchat.engine import api
from streamchat.engine.events import ItemPrefilled, NewTokens, ResponseFinished
from streamchat.text.chat import Frames

CALL, STOP, READY, OUT, BEAT, FATAL = b"call", b"stop", b"ready", b"out", b"beat", b"fatal"

# what each command returns, for decoding its reply
RESULTS: dict[type, Any] = {
    api.OpenSession: None, api.RestoreTranscript: int, api.RestoreSaved: str | None,
    api.SetInstructions: None, api.CheckRoom: None, api.Queue: int, api.StartResponse: None,
    api.CancelResponse: None, api.StopResponse: None, api.CloseSession: None, api.Prefetch: str,
    api.GetStats: api.SessionStats, api.CheckpointCandidates: list[str], api.Checkpoint: bool,
    api.Release: bool, api.Persist: int,
}
_BY_NAME = {cls.__name__: cls for cls in api.COMMANDS}


@dataclass(frozen=True)
class CoreInfo:
    """What the front needs to know of the core it started: the model as served and the pool."""

    pid: int
    model_name: str
    model_path: str
    model_folder: str  # its generation_config.json gives the sampling defaults
    tokenizer_json: str
    frames: Frames
    device: str
    dtype: str
    weights: str
    activations: str  # decode rows' products with grouped weights: float32 or int8
    threads: int  # torch's intra-op threads in the core (--num-threads, or torch's default)
    bound_cpus: list[int]  # thread i runs on bound_cpus[i] only (--bind-threads); [] where not bound
    attention: str
    kv_dtype: str  # as served (auto resolved)
    kv_dtype_reason: str  # why: as configured, or what auto measured
    data_dir: str | None
    snapshot: api.EngineSnapshot


@dataclass(frozen=True)
class Reply:
    """A command's result (msgpack of RESULTS[type]) or its error (code, message)."""

    req_id: int
    value: bytes = b"\xc0"  # msgpack of the result (nil), decoded by the command's result type
    error: tuple[str, str] | None = None


@dataclass
class StepOutput:
    """Everything one core iteration produced: commands answered, then the step's events."""

    replies: list[Reply] = field(default_factory=list)
    prefilled: list[ItemPrefilled] = field(default_factory=list)
    tokens: list[NewTokens] = field(default_factory=list)
    finished: list[ResponseFinished] = field(default_factory=list)
    samples: list[tuple[str, float]] = field(default_factory=list)  # ttft, itl, step_tokens observations
    snapshot: api.EngineSnapshot | None = None

    def add(self, events) -> None:
        for ev in events:
            {ItemPrefilled: self.prefilled, NewTokens: self.tokens, ResponseFinished: self.finished}[type(ev)].append(ev)

    def __bool__(self) -> bool:
        return bool(self.replies or self.prefilled or self.tokens or self.finished or self.samples
                    or self.snapshot is not None)


_enc = msgspec.msgpack.Encoder()
_call_head = msgspec.msgpack.Decoder(tuple[str, int, float, msgspec.Raw])
_out = msgspec.msgpack.Decoder(StepOutput)
_info = msgspec.msgpack.Decoder(CoreInfo)


def encode(obj) -> bytes:
    return _enc.encode(obj)


def call(req_id: int, deadline: float, cmd: api.Command) -> list[bytes]:
    return [CALL, _enc.encode((type(cmd).__name__, req_id, deadline, cmd))]


def decode_call(body: bytes) -> tuple[int, float, api.Command]:
    """(request id, deadline, command); ValueError for anything malformed."""
    try:
        name, req_id, deadline, raw = _call_head.decode(body)
        cls = _BY_NAME[name]
        return req_id, deadline, msgspec.msgpack.decode(raw, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
        raise ValueError(f"malformed command: {exc}") from None


def reply(req_id: int, value=None, error: tuple[str, str] | None = None) -> Reply:
    return Reply(req_id, _enc.encode(value), error)


def reply_value(r: Reply, cmd_type: type):
    return msgspec.msgpack.decode(r.value, type=RESULTS[cmd_type] or None)


def decode_out(body: bytes) -> StepOutput:
    return _out.decode(body)


def decode_info(body: bytes) -> CoreInfo:
    return _info.decode(body)


def fatal(kind: str, message: str) -> list[bytes]:
    """kind: `config` (a setting or the model is wrong: the daemon exits 2) or `error`."""
    return [FATAL, _enc.encode((kind, message))]


def decode_fatal(body: bytes) -> tuple[str, str]:
    kind, message = msgspec.msgpack.decode(body, type=tuple[str, str])
    return kind, message
