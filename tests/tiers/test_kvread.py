"""Tests of reading a saved-session file: the checksum before any field, then every field's type and range."""

import dataclasses
import functools
import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save
from tierkit import SID, VOCAB, layout, refused, snapshot, write_raw

from streamchat.config import EVICTIONS
from streamchat.tiers import kvfile, kvread
from streamchat.tiers.kvfile import SeqState, expected_tensors

def edited(path, lay, edit) -> None:
    """Rewrite `path` (a valid file) with `edit(header)` applied and a checksum that holds."""
    header, _ = kvfile.read_header(path)
    tensors = kvfile.read(path, lay, SID, vocab_size=VOCAB).tensors
    edit(header)
    write_raw(path, header, tensors)


def put(where: str, key: str, value):
    def edit(header):
        (header if where == "" else header[where])[key] = value
    return edit


def drop(where: str, key: str):
    return lambda header: (header if where == "" else header[where]).pop(key)


# Each case: an edit of a valid header (checksum recomputed), the reason, and a fragment of the message.
BAD_FIELDS = {
    "token at the vocabulary": (put("state", "token_ids", [1, 2, VOCAB]), "inconsistent",
                                f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"),
    "negative token": (put("state", "token_ids", [1, -1]), "inconsistent", "token id -1"),
    "token as text": (put("state", "token_ids", [1, "2"]), "unreadable", "not a non-empty list of whole numbers"),
    "token as bool": (put("state", "token_ids", [True]), "unreadable", "whole numbers"),
    "no tokens": (put("state", "token_ids", []), "unreadable", "non-empty"),
    "tokens as object": (put("state", "token_ids", {"0": 1}), "unreadable", "state token_ids is {'0': 1}, not a list"),
    "unknown eviction": (put("state", "eviction", "lru"), "inconsistent", "eviction 'lru' is not one of sink_window"),
    "eviction as number": (put("state", "eviction", 1), "unreadable", "state eviction is 1, not a str"),
    "scores too short": (put("state", "block_scores", [0.5]), "inconsistent", "one finite, non-negative number"),
    "score nan": (put("state", "block_scores", [0.0, math.nan, 1.0]), "inconsistent", "block_scores"),
    "score negative": (put("state", "block_scores", [0.0, -1.0, 1.0]), "inconsistent", "block_scores"),
    "score as text": (put("state", "block_scores", ["0", 0.0, 0.0]), "inconsistent", "block_scores"),
    "count as text": (put("state", "total_tokens", "72"), "unreadable", "state total_tokens is '72', not a int"),
    "count as float": (put("state", "total_tokens", 72.0), "unreadable", "not a int"),
    "count negative": (put("state", "cached_tokens", -1), "inconsistent", "state cached_tokens is -1"),
    "count huge": (put("state", "queried_tokens", 1 << 60), "inconsistent", "state queried_tokens"),
    "pristine as int": (put("state", "pristine", 0), "unreadable", "state pristine is 0, not a bool"),
    "pristine yet evicted": (put("state", "pristine", True), "inconsistent", "evicted_tokens 32 with pristine True"),
    "pinned beyond tokens": (lambda h: h["state"].update(pinned_tokens=41, num_sink_blocks=3), "inconsistent",
                             "41 pinned tokens of 40"),
    "sink blocks": (put("state", "num_sink_blocks", 2), "inconsistent", "2 sink blocks, the settings give 1"),
    "state lacks a field": (drop("state", "eviction"), "unreadable", "state lacks 'eviction'"),
    "state has more": (put("state", "extra", 1), "unreadable", "state has an unknown field 'extra'"),
    "state as list": (put("", "state", []), "unreadable", "state is not a JSON object"),
    "version as text": (put("", "version", "4"), "version", "version '4'"),
    "format": (put("", "format", "other"), "version", "format 'other'"),
    "layout value type": (put("layout", "block_size", 16.0), "foreign", "'block_size' is 16.0 in the file, 16 here"),
    "layout flag as int": (put("layout", "pin_system_prompt", 1), "foreign", "'pin_system_prompt' is 1"),
    "layout extra key": (put("layout", "rope", "yarn"), "foreign", "'rope' is 'yarn' in the file, None here"),
    "layout missing key": (drop("layout", "num_layers"), "foreign", "'num_layers' is None in the file, 2 here"),
    "layout as text": (put("", "layout", "x"), "unreadable", "layout is not a JSON object"),
    "mark as number": (put("", "transcript_mark", 5), "unreadable", "transcript_mark is 5"),
    "written_at as text": (put("", "written_at", "now"), "unreadable", "written_at is 'now', not a time"),
    "session id long": (put("", "session_id", "x" * 10_000), "foreign", "written for session 'xxx"),
}


@pytest.mark.parametrize("case", BAD_FIELDS, ids=str)
def test_every_field_is_checked_after_the_checksum(written, case):
    """A file whose checksum holds but whose field has the wrong type or range is refused with its reason."""
    lay, path = written
    edit, want_reason, fragment = BAD_FIELDS[case]
    edited(path, lay, edit)
    why, message = refused(path, lay)
    assert (why, fragment in message) == (want_reason, True), message
    assert len(message) < 300  # a value from the file is shown cut short


def test_the_checksum_is_checked_before_any_field(written):
    """A field of the wrong type in a file whose checksum fails is a checksum failure (it was never read)."""
    lay, path = written
    data = path.read_bytes()
    bad = data.replace(b'\\"total_tokens\\":72', b'\\"total_tokens\\":[]')
    assert len(bad) == len(data) and bad != data
    path.write_bytes(bad)
    assert refused(path, lay)[0] == "checksum"


def test_the_vocabulary_bound_comes_from_the_reader(written):
    """The same file is refused under a smaller vocabulary than its largest token id."""
    lay, path = written
    largest = max(kvfile.read(path, lay, SID, vocab_size=VOCAB).state.token_ids)
    assert refused(path, lay, vocab_size=largest) == (
        "inconsistent", f"inconsistent: token id {largest} is outside the vocabulary (0..{largest - 1})")
    assert kvfile.read(path, lay, SID, vocab_size=largest + 1).state.token_ids[0] == 0


def test_tensors_must_be_exactly_the_layouts(written):
    """A missing, extra, retyped or reshaped tensor under a checksum that holds is `inconsistent`."""
    lay, path = written
    header, _ = kvfile.read_header(path)
    good = kvfile.read(path, lay, SID, vocab_size=VOCAB).tensors
    cases = {"missing": {k: v for k, v in good.items() if k != "value.1"},
             "extra": {**good, "key.2": good["key.0"].clone()},
             "dtype": {**good, "key.0": good["key.0"].float()},
             "shape": {**good, "key.0": good["key.0"][:2].clone()}}
    for name, tensors in cases.items():
        write_raw(path, header, tensors)
        assert refused(path, lay)[0] == "inconsistent", name


def test_links_fifos_and_odd_json_are_unreadable(written, tmp_path):
    """A symbolic link is not followed, a FIFO not waited on, deep or non-UTF-8 JSON refused."""
    lay, path = written
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    assert refused(link, lay) == ("unreadable", "unreadable: link.safetensors: is a symbolic link")
    os.mkfifo(tmp_path / "fifo.safetensors")
    assert refused(tmp_path / "fifo.safetensors", lay) == (
        "unreadable", "unreadable: fifo.safetensors is not a regular file")
    deep = b"[" * 100_000
    path.write_bytes(len(deep).to_bytes(8, "little") + deep)
    assert refused(path, lay)[0] == "unreadable"
    meta = json.dumps({"__metadata__": {"streamchat": "\ud800", "checksum": "x"}}).encode()
    path.write_bytes(len(meta).to_bytes(8, "little") + meta)
    assert refused(path, lay) == ("unreadable", "unreadable: no streamchat header and checksum in the "
                                                "safetensors metadata")


def test_state_types_name_every_state_field():
    """The reader checks a type for each SeqState field: a new field cannot go unchecked."""
    assert list(kvread.STATE_TYPES) == [f.name for f in dataclasses.fields(SeqState)]


# -- fuzzing ---------------------------------------------------------------------------

TINY = layout(block_size=4, sink_tokens=4, window_tokens=16, num_layers=1, num_kv_heads=1, head_dim=32)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def tiny_file() -> tuple[bytes, str, dict]:
    """A valid file's bytes, its header JSON and its tensors, made once."""
    snap = snapshot(TINY, SID, num_tokens=14)
    snap.state.block_scores = [0.5, 0.0, 2.0, 1.0]
    header = json.dumps(kvfile.header_of(snap, TINY), sort_keys=True, separators=(",", ":"))
    data = save(snap.tensors, metadata={"streamchat": header, "checksum": kvfile.checksum(header, snap.tensors)})
    return data, header, snap.tensors


def assert_valid(snap) -> None:
    """What the engine relies on in a snapshot read back."""
    state = snap.state
    assert all(type(t) is int and 0 <= t < VOCAB for t in state.token_ids) and state.token_ids
    assert state.eviction in EVICTIONS and type(state.pristine) is bool
    num_blocks = state.num_blocks(TINY.block_size)
    assert len(state.block_scores) in (0, num_blocks) and all(math.isfinite(x) for x in state.block_scores)
    for name, (dtype, tail) in expected_tensors(TINY).items():
        assert snap.tensors[name].dtype == dtype and tuple(snap.tensors[name].shape) == (num_blocks, *tail)


def read_or_refuse(path) -> None:
    try:
        snap = kvfile.read(path, TINY, SID, vocab_size=VOCAB)
    except kvfile.KVFileError as exc:
        assert exc.reason in kvfile.REASONS
        return
    assert_valid(snap)


@FUZZ
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6),
       st.sampled_from(["flip", "cut", "grow"]))
def test_mutated_bytes_read_back_or_are_refused(tmp_path, edits, how):
    """Bytes overwritten anywhere, a file cut short or grown: a valid Snapshot or KVFileError, never else."""
    path = tmp_path / "fuzz.safetensors"
    data = bytearray(tiny_file()[0])
    for where, byte in edits:
        data[int(where * len(data))] = byte
    if how == "cut":
        data = data[:int(edits[0][0] * len(data))]
    elif how == "grow":
        data += bytes(b for _, b in edits)
    path.write_bytes(bytes(data))
    read_or_refuse(path)


@FUZZ
@given(st.sampled_from(["", "layout", "state", "state.token_ids", "state.block_scores"]),
       st.text(max_size=16), st.integers(0, 20), json_values, st.sampled_from(["set", "delete", "tensor"]))
def test_mutated_headers_under_a_good_checksum_read_back_or_are_refused(tmp_path, where, key, index, value, how):
    """Any field replaced by any JSON value, a field removed, or a tensor retyped, with the checksum
    recomputed: a valid Snapshot or KVFileError, never anything else."""
    path = tmp_path / "fuzz.safetensors"
    _, text, tensors = tiny_file()
    header, tensors = json.loads(text), dict(tensors)
    section, _, listed = where.partition(".")
    target = header if not section else header[section]
    keys = sorted(target) if not listed else None
    if listed:
        items = target[listed]
        items[index % len(items)] = value
    elif how == "set":
        target[keys[index % len(keys)] if index < 15 else key] = value
    elif how == "delete":
        del target[keys[index % len(keys)]]
    else:
        name = sorted(tensors)[index % len(tensors)]
        tensors[name] = tensors[name].to(torch.int8 if index % 2 else torch.float32)
    write_raw(path, header, tensors)
    read_or_refuse(path)


def test_dtypes_kvfile_writes_are_the_ones_read():
    """Every dtype a layout can give a tensor is one the structure check lets through, and no other."""
    from safetensors.torch import _TYPES

    written = {dtype for kv in ("auto", "int8", "fp8", "int4") for md in ("torch.bfloat16", "torch.float16",
               "torch.float32") for dtype, _ in expected_tensors(layout(kv_dtype=kv, model_dtype=md)).values()}
    names = {name for name, dtype in _TYPES.items() if dtype in written}
    assert names == set(kvread.DTYPES)


def _with_entry(path, name_of, change) -> str:
    """Rewrite the safetensors header of `path` with `change(entry)` applied to the entry `name_of(doc)`
    picks (the tensors' bytes as they were); that entry's name."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + n])
    name = name_of(doc)
    change(doc[name])
    head = json.dumps(doc).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    return name


def test_a_tensor_whose_bytes_do_not_fit_its_shape_or_dtype_is_unreadable(written):
    """The loader checks what safetensors checked: an entry's byte range is its shape times its dtype's size,
    and starts where its dtype may start (the tensors are views of one buffer the file is read into)."""
    lay, path = written
    good = path.read_bytes()
    def floats(doc):  # the first tensor in the file whose elements are wider than a byte
        entries = sorted((e["data_offsets"][0], k) for k, e in doc.items() if k != "__metadata__"
                         and e["dtype"] in ("BF16", "F16", "F32"))
        return entries[0][1]

    name = _with_entry(path, floats, lambda e: e["shape"].__setitem__(0, e["shape"][0] + 1))
    assert refused(path, lay) == ("unreadable", f"unreadable: tensor {name!r}: "
                                                f"{_bytes_of(good, name)} bytes for shape {_shape_of(path, name)}")
    path.write_bytes(good)
    name = _with_entry(path, floats, lambda e: e.__setitem__("data_offsets", [o + 1 for o in e["data_offsets"]]))
    assert refused(path, lay) == ("unreadable", f"unreadable: tensor {name!r} is not aligned to its dtype")
    path.write_bytes(good)
    assert kvfile.read(path, lay, SID, vocab_size=VOCAB).state is not None


def _entry(raw: bytes, name: str) -> dict:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])[name]


def _bytes_of(raw: bytes, name: str) -> int:
    start, stop = _entry(raw, name)["data_offsets"]
    return stop - start


def _shape_of(path, name: str) -> list:
    return _entry(path.read_bytes(), name)["shape"]
