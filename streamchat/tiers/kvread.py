"""Reading a saved-session file back: nothing in it is trusted before its checksum holds.

Owns the order of the checks `kvfile.read` makes; each refusal is a
KVFileError with its reason, and nothing a file can hold raises anything else:

    1. structure  a regular file (a link is not followed); the u64 header length
                  within bounds; the safetensors header a JSON object whose
                  entries each have a dtype kvfile writes, a shape and offsets
                  inside the file;
                  its metadata a header and a checksum, both strings; each
                  tensor's bytes its shape times its dtype's size, aligned to
                  that size (the tensors are views of one buffer the file is
                  read into) -> missing, unreadable, truncated
    2. checksum   over the header JSON and every tensor as loaded -> checksum
    3. fields     format and version -> version; session id and every layout
                  field, type included -> foreign; transcript mark -> stale;
                  each state field's JSON type -> unreadable; its range (token
                  ids below the vocabulary, a known eviction policy, one finite
                  score per block, counts that fit the settings) and the tensors'
                  names, dtypes and shapes as the layout and token count imply
                  -> inconsistent

The checksum finds a torn or rotted file, not a forger: whoever can write the
(0700) data directory is the daemon's user already. Step 3 keeps a
well-formed but wrong file from reaching the engine. Knows nothing about
pools, sessions or the directory.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
from pathlib import Path

import torch

from streamchat.config import EVICTIONS
from streamchat.tiers import kvfile
from streamchat.tiers.buffers import READ_BUFFERS
from streamchat.tiers.kvfile import (ANY_MARK, CHECKSUMS, KVFileError, KVLayout, SeqState, Snapshot, checksum,
                                     expected_tensors, mark_refusal)

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I8": torch.int8,
                "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}  # safetensors' names of every dtype kvfile writes
DTYPES = tuple(TORCH_DTYPES)
MAX_COUNT = 1 << 53  # counters beyond any real session (and beyond what JSON carries exactly)
STATE_TYPES = {"token_ids": list, "num_sink_blocks": int, "pinned_tokens": int, "pristine": bool,
               "evicted_tokens": int, "total_tokens": int, "cached_tokens": int, "queried_tokens": int,
               "eviction": str, "block_scores": list}


def read(path: Path, layout: KVLayout, session_id: str, mark=ANY_MARK, *, vocab_size: int) -> Snapshot:
    """The snapshot in `path`, or KVFileError saying why it must not be used."""
    with _open_regular(path) as f:  # one open: the header and the tensors come from the same file
        doc, meta, data_start, data_end = _frame(f)
        tensors, raw = _load_tensors(f, doc, data_start, data_end)
    kind = meta["checksum"].partition(":")[0]
    if kind not in CHECKSUMS:
        raise KVFileError("checksum", f"a checksum of unknown kind {_show(kind)} (known: {', '.join(CHECKSUMS)})")
    if checksum(meta["streamchat"], tensors, kind, raw) != meta["checksum"]:
        raise KVFileError("checksum", "contents do not match the checksum")
    header = _json_object(meta["streamchat"], "the streamchat header")
    _check_identity(header, layout, session_id)
    file_mark = _check_mark(header, mark)
    state = check_state(header.get("state"), layout, vocab_size)
    check_tensors(tensors, layout, state)
    return Snapshot(session_id, state, tensors, file_mark)


def read_header(path: Path) -> tuple[dict, dict]:
    """(our header, the safetensors metadata) UNCHECKED by the checksum: for tools and tests only."""
    meta = read_frame(path)[1]
    return _json_object(meta["streamchat"], "the streamchat header"), meta


# -- 1. structure ---------------------------------------------------------------------

def read_frame(path: Path) -> tuple[dict, dict]:
    """(tensor entries, metadata) of a whole safetensors file, its structure checked."""
    with _open_regular(path) as f:
        return _frame(f)[:2]


def _frame(f) -> tuple[dict, dict, int, int]:
    """read_frame's of the open file `f`, and where its tensors' bytes start and end (from that start)."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise KVFileError("truncated", f"{size} bytes: no safetensors header")
    n = int.from_bytes(raw, "little")
    if n > kvfile.MAX_HEADER_BYTES:
        raise KVFileError("unreadable", f"header length {n} is not plausible")
    if size < 8 + n:
        raise KVFileError("truncated", f"{size} bytes, header alone needs {8 + n}")
    doc = _json_object(f.read(n), "the safetensors header")
    meta = doc.pop("__metadata__", None)
    if not (isinstance(meta, dict) and _text(meta.get("streamchat")) and _text(meta.get("checksum"))):
        raise KVFileError("unreadable", "no streamchat header and checksum in the safetensors metadata")
    data_end = 0
    for name, entry in doc.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and entry.get("dtype") in DTYPES and _counts(entry.get("shape"))
                and _counts(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise KVFileError("unreadable", f"tensor entry {_show(name)} is not a saved session's tensor")
        data_end = max(data_end, offsets[1])
    if size < 8 + n + data_end:
        raise KVFileError("truncated", f"{size} bytes, the header says {8 + n + data_end}")
    return doc, meta, 8 + n, data_end


def _open_regular(path: Path):
    """`path` opened for reading if it is a regular file: no link followed, no FIFO waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KVFileError("missing", f"no file {path.name}") from None
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise KVFileError("unreadable", f"{path.name}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KVFileError("unreadable", f"{path.name} is not a regular file")
    return open(fd, "rb")


def _load_tensors(f, doc: dict, data_start: int, end: int) -> tuple[dict, dict]:
    """Every tensor `doc` describes, as views of one buffer the file's bytes are read into; and each
    one's bytes as a memoryview of that buffer (for the checksum).

    One read into memory torch owns, with the GIL released. safetensors' load_file
    held the GIL in long stretches (a thread polling every 0.5 ms beside it waited
    2.3 ms at p99 and 7.0 ms at worst on a 12 MB file; 0.19 and 2.2 ms beside this
    loader), and the reader thread runs at SCHED_IDLE: preempted while it holds
    the GIL, it holds up the step loop's thread until it gets a core again. So
    what is left here holds the GIL briefly: one strided view a tensor (0.22
    against 0.48 ms for 120 tensors as slice, dtype view and reshape). The
    buffer is one used before where one is free (see `buffers`).
    """
    buf = READ_BUFFERS.take(end)
    data = memoryview(buf.numpy())
    try:
        f.seek(data_start)
        got = f.readinto(data)
    except OSError as exc:
        raise KVFileError("unreadable", f"tensors: {_show(exc.strerror or str(exc))}") from None
    if got != end:
        raise KVFileError("truncated", f"tensors: {got} of {end} bytes")
    typed: dict[torch.dtype, torch.Tensor] = {}  # the whole buffer seen as each dtype used
    tensors, raw = {}, {}
    for name, entry in doc.items():
        dtype = TORCH_DTYPES[entry["dtype"]]
        (start, stop), shape = entry["data_offsets"], entry["shape"]
        size = dtype.itemsize
        if stop - start != math.prod(shape) * size:
            raise KVFileError("unreadable", f"tensor {_show(name)}: {stop - start} bytes for shape {shape}")
        if start % size:
            raise KVFileError("unreadable", f"tensor {_show(name)} is not aligned to its dtype")
        if dtype not in typed:
            typed[dtype] = buf[:end - end % size].view(dtype)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        tensors[name] = typed[dtype].as_strided(shape, strides[::-1], start // size)
        raw[name] = data[start:stop]
    return tensors, raw


def _json_object(text: str | bytes, what: str) -> dict:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise KVFileError("unreadable", f"{what} is not JSON ({_show(str(exc))})") from None
    if not isinstance(doc, dict):
        raise KVFileError("unreadable", f"{what} is not a JSON object")
    return doc


# -- 3. fields ------------------------------------------------------------------------

def _check_identity(header: dict, layout: KVLayout, session_id: str) -> None:
    """Format and version, then whether the file is this session's under this model and these settings."""
    fmt, version = header.get("format"), header.get("version")
    if fmt != kvfile.FORMAT or type(version) is not int or version != kvfile.VERSION:
        raise KVFileError("version", f"format {_show(fmt)} version {_show(version)}, "
                                     f"this daemon reads {kvfile.FORMAT!r} version {kvfile.VERSION}")
    written_at = header.get("written_at")
    if type(written_at) not in (int, float) or not 0 <= written_at < math.inf:
        raise KVFileError("unreadable", f"written_at is {_show(written_at)}, not a time")
    if header.get("session_id") != session_id:
        raise KVFileError("foreign", f"written for session {_show(header.get('session_id'))}")
    ours, theirs = layout.to_json(), header.get("layout")
    if not isinstance(theirs, dict):
        raise KVFileError("unreadable", "layout is not a JSON object")
    for key in [*ours, *sorted(set(theirs) - set(ours))]:
        value = theirs.get(key)
        if key not in theirs or type(value) is not type(ours.get(key)) or value != ours.get(key):
            raise KVFileError("foreign", _difference(key, value, ours.get(key)))


def _difference(key: str, theirs, ours) -> str:
    """What differs, naming the first layer whose spec differs rather than every layer's."""
    if key == "kv_specs" and isinstance(theirs, list) and isinstance(ours, list) and len(theirs) == len(ours):
        layer = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
        return f"kv_specs of layer {layer} is {_show(theirs[layer], 200)} in the file, {_show(ours[layer], 200)} here"
    return f"{_show(key)} is {_show(theirs)} in the file, {_show(ours)} here"


def _check_mark(header: dict, mark) -> str | None:
    """The transcript mark the file was written with, if it is the one asked for."""
    theirs = header.get("transcript_mark")
    if theirs is not None and not isinstance(theirs, str):
        raise KVFileError("unreadable", f"transcript_mark is {_show(theirs)}")
    refusal = mark_refusal(mark, theirs)
    if refusal is not None:
        raise KVFileError("stale", refusal)
    return theirs


def check_state(raw: object, layout: KVLayout, vocab_size: int) -> SeqState:
    """The SeqState a header's `state` describes, every field's type and range checked."""
    if not isinstance(raw, dict):
        raise KVFileError("unreadable", "state is not a JSON object")
    odd = sorted(set(raw) ^ set(STATE_TYPES))
    if odd:
        raise KVFileError("unreadable", f"state {'lacks' if odd[0] in STATE_TYPES else 'has an unknown field'} "
                                        f"{_show(odd[0])}")
    for name, kind in STATE_TYPES.items():
        if type(raw[name]) is not kind:
            raise KVFileError("unreadable", f"state {name} is {_show(raw[name])}, not a {kind.__name__}")
        if kind is int and not 0 <= raw[name] < MAX_COUNT:
            raise KVFileError("inconsistent", f"state {name} is {_show(raw[name])}")
    state = SeqState(**raw)
    _check_tokens(state.token_ids, vocab_size)
    _check_eviction(state, layout.block_size)
    _check_regions(state, layout)
    return state


def _check_tokens(tokens: list, vocab_size: int) -> None:
    if not tokens or not all(type(t) is int for t in tokens):
        raise KVFileError("unreadable", "token_ids is not a non-empty list of whole numbers")
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= vocab_size:
        raise KVFileError("inconsistent", f"token id {low if low < 0 else high} is outside the vocabulary "
                                          f"(0..{vocab_size - 1})")


def _check_eviction(state: SeqState, block_size: int) -> None:
    if state.eviction not in EVICTIONS:
        raise KVFileError("inconsistent", f"eviction {_show(state.eviction)} is not one of {', '.join(EVICTIONS)}")
    scores = state.block_scores
    if len(scores) not in (0, state.num_blocks(block_size)) or not all(
            type(x) in (int, float) and 0 <= x < math.inf for x in scores):
        raise KVFileError("inconsistent", "block_scores is not one finite, non-negative number per block")


def _check_regions(state: SeqState, layout: KVLayout) -> None:
    """Sinks, pinned prompt, window and eviction counts as the settings allow."""
    bs, num_tokens = layout.block_size, len(state.token_ids)
    sink_blocks = -(-max(layout.sink_tokens, state.pinned_tokens) // bs)
    window_cap = -(-layout.window_tokens // bs) * bs
    if state.num_sink_blocks != sink_blocks:
        raise KVFileError("inconsistent", f"{state.num_sink_blocks} sink blocks, the settings give {sink_blocks}")
    if state.pinned_tokens > num_tokens or (state.pinned_tokens and not layout.pin_system_prompt):
        raise KVFileError("inconsistent", f"{state.pinned_tokens} pinned tokens of {num_tokens}, "
                                          f"pin_system_prompt {layout.pin_system_prompt}")
    if num_tokens > sink_blocks * bs + window_cap:
        raise KVFileError("inconsistent", f"{num_tokens} tokens do not fit sinks + window")
    if state.evicted_tokens and state.pristine:
        raise KVFileError("inconsistent", f"evicted_tokens {state.evicted_tokens} with pristine {state.pristine}")


def check_tensors(tensors: dict, layout: KVLayout, state: SeqState) -> None:
    """Exactly the tensors the layout names, each of its dtype and of one row per block of tokens."""
    expect = expected_tensors(layout)
    if set(tensors) != set(expect):
        names = sorted(set(tensors) ^ set(expect))
        raise KVFileError("inconsistent", f"tensors {_show(names)} do not fit the layout")
    num_blocks = state.num_blocks(layout.block_size)
    for name, (dtype, tail) in expect.items():
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != (num_blocks, *tail):
            raise KVFileError("inconsistent", f"{name} is {t.dtype} {tuple(t.shape)}, "
                                              f"expected {dtype} {(num_blocks, *tail)}")


def _text(value: object) -> bool:
    """A string that is UTF-8 (JSON's \\ud800 escapes make ones that are not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _counts(value: object) -> bool:
    """A list of non-negative whole numbers (a shape, offsets)."""
    return isinstance(value, list) and all(type(x) is int and 0 <= x < MAX_COUNT for x in value)


def _show(value: object, limit: int = 60) -> str:
    """A value from a file, for a message: repr, cut short (a file may hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
