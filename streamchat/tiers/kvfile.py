"""The saved-session file: one self-contained, checked safetensors file per session.

Owns the format, writing it atomically (mode 0600) and reading it back; the
checks that decide whether its KV may be used are `kvread`'s. Knows nothing
about pools, sessions or the engine: it is handed a `Snapshot` (the
session's blocks copied out in table order, plus the state that goes with
them) and hands one back.

    file  = safetensors: u64 header length | JSON header | tensor bytes
    tensors   {name}.{layer}: each layer's pool tensors as its KV spec names them
              (streamchat/model/kv_spec.py), (num_blocks, *one block's shape):
                full attention  key, value (block_size, kv_heads, head_dim*); k_scale, v_scale
                                for --kv-dtype int8 / fp8 / int4 (see kernels/quant.py)
                MLA             latent (block_size, latent_dim + rope_dim*); latent_scale
                                for int8 / fp8 / int4
              row i is the session's block i: cache positions i*block_size .. +block_size-1
              (* halved for int4: two values a byte)
    metadata  "streamchat": the header below, JSON
              "checksum":   "xxh3-128:" + 32 hex digits over the header JSON and, by name, each
                            tensor's name, dtype, shape and bytes (files written before
                            2026-12-06 carry "crc32:" + 8 hex digits, and before 2026-12-05
                            "blake2b-128:" + hex, over the same bytes; all three are read)

    header    format "streamchat.kv", version 5, session_id, written_at (unix s),
              transcript_mark (what the store held when it was written; null if unknown),
              layout: model_fingerprint, model_dtype, kv_dtype, block_size, sink_tokens,
                      window_tokens, pin_system_prompt, num_layers, kv_specs (per layer:
                      {"kind": "full_attention", "num_kv_heads", "head_dim"} or
                      {"kind": "mla", "latent_dim", "rope_dim"})
              state:  token_ids (cache order: token i sits at cache position i),
                      num_sink_blocks, pinned_tokens, pristine, evicted_tokens,
                      total_tokens, cached_tokens, queried_tokens, eviction,
                      block_scores (h2o: attention mass per block, table order)

Each key (and each latent's rotary part) is stored rotated by its offset in
its block (0..block_size-1), never by its cache position, so the blocks may
go back into any physical blocks, in this order. Older versions are refused
with reason "version" (the session is rebuilt from its transcript, as for
any file that cannot be used): version 1 held keys before rotary embedding,
version 2 int4 key scales per token, version 3 symmetric int4 (a scale per
group, no minimum), version 4 a layout of num_kv_heads and head_dim (no
per-layer specs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import math
import os
import secrets
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

FORMAT = "streamchat.kv"
VERSION = 5  # 5: per-layer KV specs in the layout (MLA latents); 4: int4 asymmetric, (scale, min) per
#              group; 3: int4 key scales per channel per block; 2: keys rotated by their offset in
#              their block; 1: keys before rotary embedding
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
MAX_HEADER_BYTES = 64 << 20
# Why a saved file was not used; also the `reason` label of the load-failure metric.
REASONS = ("missing", "unreadable", "truncated", "version", "foreign", "checksum", "inconsistent",
           "stale", "prompt", "no_room")


class KVFileError(Exception):
    """A saved file that must not be used; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """Everything a block's bytes depend on besides the tokens: must match to reuse a file."""

    model_fingerprint: str
    model_dtype: str
    kv_dtype: str
    block_size: int
    sink_tokens: int
    window_tokens: int
    pin_system_prompt: bool
    kv_specs: tuple  # one KVSpec per layer (model/kv_spec.py)

    @classmethod
    def of(cls, runner, cache_cfg) -> KVLayout:
        return cls(runner.loaded.source.fingerprint, str(runner.model.dtype), runner.kv_dtype,
                   cache_cfg.block_size, cache_cfg.sink_tokens, cache_cfg.window_tokens,
                   cache_cfg.pin_system_prompt, tuple(runner.kv_specs))

    def to_json(self) -> dict:
        """The layout as a file's header holds it: each spec by its description."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kv_specs"}
        return {**fields, "num_layers": len(self.kv_specs), "kv_specs": [s.describe() for s in self.kv_specs]}


@dataclass
class SeqState:
    """A session's cache apart from its tensors: what a block table is rebuilt from."""

    token_ids: list[int]  # cache order
    num_sink_blocks: int
    pinned_tokens: int
    pristine: bool
    evicted_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    queried_tokens: int = 0
    eviction: str = "sink_window"
    block_scores: list[float] = field(default_factory=list)  # empty: all zero

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // block_size)


@dataclass
class Snapshot:
    """A session's blocks copied out of a pool, in table order, with their state."""

    session_id: str
    state: SeqState
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (num_blocks, block_size, ...)
    mark: str | None = None  # the transcript it matches (see streamchat.server.sessions)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as uint8 if its dtype is a one-byte float (fp8): a block copy needs only the bytes, and torch
    has no CPU index_copy_ for fp8."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))
WORD_ROWS = 8  # copies of fewer rows than this stay elementwise: viewing costs more than it saves


def words(*ts: torch.Tensor, copied: int = WORD_ROWS) -> tuple[torch.Tensor, ...]:
    """Contiguous tensors of equal row size, (n, ...) each, as (n, W) raw words of one integer type: the
    widest that their row bytes and addresses allow (bytes at worst), never a copy. A row copy
    (index_copy_ or index_select on dim 0) of `copied` rows then moves words, not elements: 63 blocks of
    30 int8 layers with their scales (a ~1,000-token page-in) went into a pool in 4.5 ms as words, 8.6 ms
    elementwise; 16 blocks 2.1 against 2.7 ms; 1 block 1.6 against 0.9 (one process, interleaved, 2-core
    EPYC). Below WORD_ROWS rows, or not contiguous, they come back as `byte_view`s, as before."""
    if copied < WORD_ROWS or not all(t.is_contiguous() for t in ts):
        return tuple(byte_view(t) for t in ts)
    flat = [t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8) for t in ts]
    row_bytes = flat[0].shape[1]
    for width, dtype in _WORDS:
        if row_bytes % width == 0 and all(f.data_ptr() % width == 0 for f in flat):
            return tuple(f.view(dtype) for f in flat)
    return tuple(flat)


def gather(caches, block_ids: list[int]) -> dict[str, torch.Tensor]:
    """Copy blocks out of per-layer pools (LayerKV, LatentKV) into CPU tensors, in the given order."""
    out = {}
    for layer, kv in enumerate(caches):
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv[0].device)
        for name, t in zip(kv._fields, kv):
            if t is not None:
                (rows,) = words(t, copied=len(block_ids))
                picked = rows.index_select(0, idx).cpu()
                out[f"{name}.{layer}"] = picked.view(torch.uint8).view(t.dtype).reshape(len(block_ids), *t.shape[1:])
    return out


# memmove called without giving up the GIL (PyDLL): on the step's thread a release lets another thread take
# the GIL, and the step waits up to the switch interval (5 ms) to get it back.
_memmove = ctypes.PyDLL(None).memmove
_memmove.argtypes, _memmove.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p


def copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> bool:
    """dst[dst_rows[i]] = src[src_rows[i]] for each i, row by row with memmove, where both are contiguous CPU
    tensors of one dtype and row shape (else False: nothing copied, the caller copies with torch). For
    a few rows: one block of 30 int8 layers with their scales (120 tensors) went into a pool in 0.48 ms
    against 0.84 by index_copy_, 7 blocks 0.85 against 2.0 (`scatter`, one process, alternating).
    IndexError for a row out of range, as torch would raise, before anything is copied."""
    if (not dst.is_cpu or not src.is_cpu or dst.dtype != src.dtype or dst.dim() == 0
            or dst.shape[1:] != src.shape[1:] or not dst.is_contiguous() or not src.is_contiguous()):
        return False
    if len(dst_rows) != len(src_rows):
        raise ValueError(f"{len(dst_rows)} rows into {len(src_rows)}")
    if not dst_rows:
        return True
    if min(dst_rows) < 0 or max(dst_rows) >= len(dst) or min(src_rows) < 0 or max(src_rows) >= len(src):
        raise IndexError(f"rows {dst_rows} of {len(dst)} from rows {src_rows} of {len(src)}")
    n = dst.numel() // len(dst) * dst.element_size()  # a row's bytes
    to, frm = dst.data_ptr(), src.data_ptr()
    for d, r in zip(dst_rows, src_rows):
        _memmove(to + d * n, frm + r * n, n)
    return True


def scatter(tensors: dict[str, torch.Tensor], rows: list[int], caches, block_ids: list[int]) -> None:
    """Write rows `rows` of snapshot tensors into pool blocks `block_ids` (same length). Runs on the engine
    core's step thread: a few rows go by `copy_rows`; rows that follow each other (a page-in's usual case)
    are read where they lie."""
    few = len(rows) < WORD_ROWS
    run = rows == list(range(rows[0], rows[0] + len(rows))) if rows else False  # most page-ins: a view, no copy
    dst, src = {}, None  # the index tensors, built once and only if a copy needs them
    for layer, kv in enumerate(caches):
        for name, t in zip(kv._fields, kv):
            if t is None:
                continue
            whole = tensors[f"{name}.{layer}"]
            if few and copy_rows(t, block_ids, whole, rows):
                continue
            if t.device not in dst:
                dst[t.device] = torch.tensor(block_ids, dtype=torch.long, device=t.device)
            if not run and src is None:
                src = torch.tensor(rows, dtype=torch.long)
            rows_of = whole.narrow(0, rows[0], len(rows)) if run else whole.index_select(0, src)
            pool_rows, new_rows = words(t, rows_of.to(t.device), copied=len(rows))
            pool_rows.index_copy_(0, dst[t.device], new_rows)


def expected_tensors(layout: KVLayout) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape after the leading num_blocks) of a file for this layout, from its specs."""
    return {f"{t.name}.{layer}": (t.dtype, t.shape)
            for layer, spec in enumerate(layout.kv_specs) for t in spec.tensors()}


# -- writing ------------------------------------------------------------------------

def header_of(snap: Snapshot, layout: KVLayout) -> dict:
    return {"format": FORMAT, "version": VERSION, "session_id": snap.session_id,
            "written_at": round(time.time(), 3), "transcript_mark": snap.mark,
            "layout": layout.to_json(), "state": dataclasses.asdict(snap.state)}


def write_atomic(path: Path, snap: Snapshot, layout: KVLayout) -> int:
    """Write `snap` to `path` all or nothing; returns the file's size.

    Temp file (mode 0600) in the same directory, fsync, rename over `path`,
    fsync the directory: a crash at any moment leaves the old file or the new
    one, never a mix, plus at worst a temp file that `DiskTier` removes on
    start.
    """
    from safetensors.torch import save_file

    header = json.dumps(header_of(snap, layout), sort_keys=True, separators=(",", ":"))
    metadata = {"streamchat": header, "checksum": checksum(header, snap.tensors)}
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # save_file keeps the mode
        save_file(snap.tensors, str(tmp), metadata=metadata)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path.stat().st_size


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The checksum finds a torn or rotted file (see kvread); it is not a defence against a forger. Over a
# ~1,000-token int8 file (13 MB) here: blake2b 12.4 ms, zlib's CRC-32 3.2-3.8 ms, XXH3-128 0.24 ms,
# on threads that share the cores with the decode step (bench/pagein_itl.py). Files of the older
# kinds stay readable.
CHECKSUMS = ("xxh3-128", "crc32", "blake2b-128")  # what a file may carry; the first is what write_atomic writes


def _checksum_parts(header_json: str, tensors: dict[str, torch.Tensor], raw: dict | None):
    yield header_json.encode()
    for name in sorted(tensors):
        t = tensors[name]
        yield f"\0{name}:{t.dtype}:{tuple(t.shape)}\0".encode()
        yield raw[name] if raw is not None else t.contiguous().reshape(-1).view(torch.uint8).numpy()


def checksum(header_json: str, tensors: dict[str, torch.Tensor], kind: str = CHECKSUMS[0],
             raw: dict | None = None) -> str:
    """`kind:hex` over the header and the tensors; KeyError for a kind not in CHECKSUMS. `raw`: each
    tensor's bytes (a buffer), where the caller has them: a third of the time of converting each tensor
    (0.42 against 1.28 ms over a 12 MB file), spent holding the GIL."""
    parts = _checksum_parts(header_json, tensors, raw)
    if kind == "xxh3-128":
        h = xxhash.xxh3_128()
        for part in parts:
            h.update(part)
        return "xxh3-128:" + h.hexdigest()
    if kind == "crc32":
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return f"crc32:{crc:08x}"
    if kind == "blake2b-128":
        h = hashlib.blake2b(digest_size=16)
        for part in parts:
            h.update(part)
        return "blake2b-128:" + h.hexdigest()
    raise KeyError(kind)


# -- reading ------------------------------------------------------------------------

ANY_MARK = object()  # read(): accept whatever transcript mark the file has
EPOCH_SEP = "@"  # a mark may end in @<lease epoch>: the epoch of the lease it was written under


def mark_refusal(asked, theirs: str | None) -> str | None:
    """Why a file stamped `theirs` must not serve a load asking for `asked`, or None if it may.

    Marks compare whole, except their epochs (`transcript@epoch`, a fleet's
    session leases): the transcripts must be equal and the file's epoch at
    least the asked one, so a file from an older lease holder than the one
    the load names (a daemon that paused past its lease) is refused.
    """
    if asked is ANY_MARK or theirs == asked:
        return None
    if not theirs:
        return "written without a transcript mark"
    ours, _, low = asked.rpartition(EPOCH_SEP)
    file_mark, _, epoch = theirs.rpartition(EPOCH_SEP)
    if not (ours and file_mark and low.isdigit() and epoch.isdigit()) or file_mark != ours:
        return "the transcript changed after the file was written"
    if int(epoch) < int(low):
        return f"written under lease epoch {epoch}, older than {low}, the oldest this load accepts"
    return None


def read(path: Path, layout: KVLayout, session_id: str, mark=ANY_MARK, *, vocab_size: int) -> Snapshot:
    """The snapshot in `path`, or KVFileError saying why it must not be used.

    Nothing in the file is trusted before its checksum holds; then every
    field is checked (token ids below `vocab_size`); see `kvread`.
    """
    from streamchat.tiers import kvread

    return kvread.read(path, layout, session_id, mark, vocab_size=vocab_size)


def read_header(path: Path) -> tuple[dict, dict]:
    """(our header, the safetensors metadata) NOT checked by the checksum: for tools and tests (see kvread)."""
    from streamchat.tiers import kvread

    return kvread.read_header(path)
