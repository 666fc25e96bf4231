"""Tests of the saved-session file: exact round trips, and every kind of bad file refused with its reason."""

import json
import os

import pytest
import torch
from tierkit import SID, VOCAB, layout, refused, same_bytes, snapshot, write_raw

from streamchat.tiers import kvfile, kvread


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8", "int4"])
def test_round_trip_is_bit_exact_for_every_kv_dtype(tmp_path, kv_dtype):
    """Tensors, scales and state come back bit for bit; the header says what the file holds."""
    lay = layout(kv_dtype=kv_dtype)
    snap = snapshot(lay)
    path = tmp_path / "s.safetensors"
    size = kvfile.write_atomic(path, snap, lay)
    assert size == path.stat().st_size
    back = kvfile.read(path, lay, snap.session_id, mark="m1", vocab_size=VOCAB)
    assert same_bytes(back.tensors, snap.tensors)
    assert back.state == snap.state and back.mark == "m1"
    header, meta = kvfile.read_header(path)
    assert header["format"] == "streamchat.kv" and header["version"] == 5
    assert header["layout"]["kv_dtype"] == kv_dtype and header["state"]["token_ids"] == snap.state.token_ids
    assert meta["checksum"].startswith("xxh3-128:") and len(meta["checksum"]) == len("xxh3-128:") + 32
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_corrupt_tensor_bytes_and_header_fail_the_checksum(written):
    """One flipped byte in the tensors, or an edited header field, is a checksum failure."""
    lay, path = written
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    assert refused(path, lay)[0] == "checksum"
    data[-100] ^= 0x01
    edited = bytes(data).replace(b'\\"total_tokens\\":72', b'\\"total_tokens\\":73')
    assert edited != bytes(data)
    path.write_bytes(edited)
    assert refused(path, lay)[0] == "checksum"


def _rewritten(path, checksum) -> None:
    """Rewrite `path` with the same header and tensors under `checksum(header_json, tensors)`."""
    with open(path, "rb") as f:
        doc, _, start, end = kvread._frame(f)
        tensors = {k: v.clone() for k, v in kvread._load_tensors(f, doc, start, end)[0].items()}
    write_raw(path, None, tensors, header_json=kvfile.read_header(path)[1]["streamchat"], checksum=checksum)


@pytest.mark.parametrize("kind", ["crc32", "blake2b-128"])
def test_a_file_written_with_an_older_checksum_is_still_read(written, kind):
    """Files saved before the XXH3 change (CRC-32) and before that (blake2b) resume exactly;
    a flipped byte fails their checksum too."""
    lay, path = written
    want = kvfile.read(path, lay, SID, vocab_size=VOCAB)
    _rewritten(path, lambda h, t: kvfile.checksum(h, t, kind))
    assert kvfile.read_header(path)[1]["checksum"].startswith(kind + ":")
    back = kvfile.read(path, lay, SID, vocab_size=VOCAB)
    assert same_bytes(back.tensors, want.tensors) and back.state == want.state
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    assert refused(path, lay)[0] == "checksum"


def test_a_checksum_of_an_unknown_kind_is_refused_naming_the_known(written):
    lay, path = written
    _rewritten(path, lambda h, t: "sha256:" + "0" * 64)
    reason, message = refused(path, lay)
    assert reason == "checksum" and "sha256" in message and "xxh3-128, crc32, blake2b-128" in message, message


@pytest.mark.parametrize("keep", [0, 5, 8, 200, -1, -4096])
def test_truncated_files_are_refused(written, keep):
    """A file cut anywhere (in the length, the header or the tensors) is `truncated`."""
    lay, path = written
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    assert refused(path, lay)[0] == "truncated"


def test_garbage_and_missing_files_are_refused(written, tmp_path):
    """A file that is not ours is `unreadable`; no file is `missing`."""
    lay, path = written
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!" + b"x" * 64)
    assert refused(path, lay)[0] == "unreadable"
    assert refused(tmp_path / "nothing.safetensors", lay)[0] == "missing"


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "fp-other"), ("model_dtype", "torch.float32"), ("kv_dtype", "int8"),
    ("block_size", 32), ("sink_tokens", 8), ("window_tokens", 128), ("num_layers", 3)])
def test_foreign_files_are_refused_naming_what_differs(written, field, value):
    """A file from another model, dtype, KV dtype, block size or sink/window setting is `foreign`."""
    _, path = written
    why, message = refused(path, layout(**{field: value}))
    assert why == "foreign" and field in message


def test_other_session_version_and_stale_mark_are_refused(written, monkeypatch):
    """Another session's file is `foreign`; another format version `version`; another transcript `stale`."""
    lay, path = written
    assert refused(path, lay, session_id="sess_" + "cd" * 16)[0] == "foreign"
    assert refused(path, lay, mark="m2")[0] == "stale"
    assert kvfile.read(path, lay, "sess_" + "ab" * 16, mark="m1", vocab_size=VOCAB).mark == "m1"
    monkeypatch.setattr(kvfile, "VERSION", kvfile.VERSION + 1)
    assert refused(path, lay)[0] == "version"


def test_a_fleets_mark_takes_the_same_transcript_at_the_asked_lease_epoch_or_newer(tmp_path):
    """`transcript@epoch` marks: a file of the asked epoch or a newer one serves; an older holder's file, or
    another transcript at any epoch, is `stale`, its message naming the epochs."""
    lay = layout()
    path = tmp_path / "s.safetensors"
    kvfile.write_atomic(path, snapshot(lay, mark="t1@2"), lay)
    for asked in ("t1@1", "t1@2"):
        assert kvfile.read(path, lay, SID, mark=asked, vocab_size=VOCAB).mark == "t1@2"
    why, message = refused(path, lay, mark="t1@3")
    assert (why, message) == ("stale", "stale: written under lease epoch 2, older than 3, the oldest this load accepts")
    assert refused(path, lay, mark="t2@1") == ("stale", "stale: the transcript changed after the file was written")
    assert refused(path, lay, mark="t1")[0] == "stale"  # a mark without an epoch compares whole


@pytest.mark.parametrize("old", [1, 2, 3, 4])
def test_older_versions_are_refused(tmp_path, monkeypatch, old):
    """A whole, checksummed file of version 1 (keys stored before rotary embedding), 2 (int4 key
    scales per token), 3 (symmetric int4) or 4 (no per-layer specs) is refused as `version`."""
    lay = layout(kv_dtype="int4")
    path = tmp_path / "s.safetensors"
    with monkeypatch.context() as m:
        m.setattr(kvfile, "VERSION", old)
        kvfile.write_atomic(path, snapshot(lay), lay)
    assert kvfile.read_header(path)[0]["version"] == old
    why, message = refused(path, lay)
    assert why == "version" and f"version {old}" in message and f"version {kvfile.VERSION}" in message


def test_tensors_that_do_not_fit_the_state_are_inconsistent(tmp_path):
    """Tensors with the wrong number of blocks for the token count are `inconsistent`."""
    lay = layout()
    snap = snapshot(lay, num_tokens=40)
    snap.state.token_ids = snap.state.token_ids[:10]  # 1 block of tokens, 3 blocks of tensors
    path = tmp_path / "s.safetensors"
    kvfile.write_atomic(path, snap, lay)
    assert refused(path, lay)[0] == "inconsistent"


def test_write_is_atomic_and_fsynced(written, monkeypatch):
    """A write that fails before the rename leaves the old file whole and no temp file; a good one fsyncs."""
    lay, path = written
    old = path.read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvfile.os, "replace", crash)
    with pytest.raises(OSError):
        kvfile.write_atomic(path, snapshot(lay, seed=1), lay)
    assert path.read_bytes() == old and [p.name for p in path.parent.iterdir()] == [path.name]
    monkeypatch.undo()
    synced = []
    real = os.fsync
    monkeypatch.setattr(kvfile.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    kvfile.write_atomic(path, snapshot(lay, seed=1), lay)
    assert synced[0].endswith(kvfile.TMP_SUFFIX) and synced[1] == str(path.parent)
    assert torch.equal(kvfile.read(path, lay, "sess_" + "ab" * 16, vocab_size=VOCAB).tensors["key.0"].float(),
                       snapshot(lay, seed=1).tensors["key.0"].float())
    assert json.loads(kvfile.read_header(path)[1]["streamchat"])["state"]["token_ids"][0] == 1


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [2, 3, 4], [0, 2, 3], [4, 1], []])
def test_scatter_writes_each_asked_row_into_its_block_and_nothing_else(rows):
    """Rows that follow each other (read in place) and rows that do not (gathered) land alike."""
    from streamchat.model.attention import LayerKV

    g = torch.Generator().manual_seed(len(rows))
    tensors = {f"{n}.{layer}": torch.randint(-127, 128, (5, 4, 2, 8), dtype=torch.int8, generator=g)
               for layer in range(2) for n in ("key", "value")}
    caches = [LayerKV(torch.zeros(12, 4, 2, 8, dtype=torch.int8), torch.zeros(12, 4, 2, 8, dtype=torch.int8))
              for _ in range(2)]
    blocks = [11, 3, 7, 5, 9][:len(rows)]
    kvfile.scatter(tensors, rows, caches, blocks)
    for layer, kv in enumerate(caches):
        for name in ("key", "value"):
            pool = getattr(kv, name)
            for r, b in zip(rows, blocks):
                assert torch.equal(pool[b], tensors[f"{name}.{layer}"][r])
            untouched = [b for b in range(12) if b not in blocks]
            assert not pool[untouched].any()


def test_words_views_rows_as_the_widest_words_their_size_and_address_allow():
    """A row copy moves words: int64 where the row bytes and every tensor's address allow, narrower where
    they do not, never a copy; a tensor that is not contiguous is left as it was."""
    x = torch.arange(4 * 24, dtype=torch.int8).reshape(4, 2, 12)  # rows of 24 bytes
    assert kvfile.words(x, copied=kvfile.WORD_ROWS - 1)[0].dtype == torch.int8  # a few rows: elementwise
    (w,) = kvfile.words(x)
    assert (w.dtype, tuple(w.shape), w.data_ptr()) == (torch.int64, (4, 3), x.data_ptr())
    buf = torch.zeros(4 * 24 + 2, dtype=torch.uint8)
    assert kvfile.words(buf[2:26].view(4, 6))[0].dtype == torch.int16  # 6-byte rows, 2 bytes past aligned
    shifted = buf[1:97].view(4, 24).view(torch.int8)
    assert [t.dtype for t in kvfile.words(x, shifted)] == [torch.uint8, torch.uint8]  # one odd address: bytes
    assert kvfile.words(x[:, :, ::2])[0].dtype == torch.int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_gather_copies_blocks_out_in_their_dtype_and_shape(dtype):
    from streamchat.model.attention import LayerKV

    g = torch.Generator().manual_seed(3)
    pool = [LayerKV(torch.randn(16, 4, 2, 8, generator=g).mul(20).to(dtype),
                    torch.randn(16, 4, 2, 8, generator=g).mul(20).to(dtype)) for _ in range(2)]
    for ids in ([7, 2, 5], [7, 2, 5, 15, 1, 9, 8, 3, 11]):  # elementwise, then as words
        got = kvfile.gather(pool, ids)
        for layer, kv in enumerate(pool):
            for name in ("key", "value"):
                out, want = got[f"{name}.{layer}"], getattr(kv, name)[ids]
                assert out.dtype == dtype and out.shape == want.shape
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("rows", [list(range(1, 11)), [9, 0, 3, 2, 8, 7, 1, 4, 6, 5]])
def test_scatter_of_many_rows_moves_words_and_lands_them_exactly(rows):
    """Ten rows (as words) of int8 codes and float32 scales, read in place or gathered, land bit for bit."""
    from collections import namedtuple

    kv_type = namedtuple("KV", "key value k_scale v_scale")
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, shape, dtype in (("key", (4, 2, 8), torch.int8), ("value", (4, 2, 8), torch.int8),
                               ("k_scale", (4, 2), torch.float32), ("v_scale", (4, 2), torch.float32)):
        tensors[f"{name}.0"] = (torch.randint(-127, 128, (11, *shape), dtype=dtype, generator=g) if dtype == torch.int8
                                else torch.rand(11, *shape, generator=g))
    pool = [kv_type(*(torch.zeros(16, *tensors[f"{n}.0"].shape[1:], dtype=tensors[f"{n}.0"].dtype)
                      for n in kv_type._fields))]
    blocks = [14, 2, 9, 5, 11, 3, 7, 12, 1, 6]
    kvfile.scatter(tensors, rows, pool, blocks)
    for name in kv_type._fields:
        for r, b in zip(rows, blocks):
            assert torch.equal(getattr(pool[0], name)[b], tensors[f"{name}.0"][r])
        assert not getattr(pool[0], name)[[b for b in range(16) if b not in blocks]].any()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_copy_rows_moves_a_few_rows_exactly_and_refuses_what_it_cannot(dtype):
    """A few rows by memmove land bit for bit in any dtype; a tensor that is not contiguous, or of another
    dtype, is left to torch (False, nothing written); a row out of range raises before anything moves."""
    g = torch.Generator().manual_seed(7)
    src = torch.randn(6, 4, 3, generator=g).mul(20).to(dtype)
    dst = torch.zeros(10, 4, 3, dtype=dtype)
    assert kvfile.copy_rows(dst, [9, 0, 4], src, [5, 2, 2])
    for d, r in ((9, 5), (0, 2), (4, 2)):
        assert torch.equal(dst[d].view(torch.uint8), src[r].view(torch.uint8))
    assert not dst[[1, 2, 3, 5, 6, 7, 8]].view(torch.uint8).any()
    fresh = torch.zeros(10, 4, 3, dtype=dtype)
    assert not kvfile.copy_rows(fresh[:, :, :2], [1], src[:, :, :2], [1])  # not contiguous
    assert not kvfile.copy_rows(fresh, [1], src.view(torch.uint8) if dtype.itemsize == 1 else src.float().half(), [1])
    with pytest.raises(IndexError):
        kvfile.copy_rows(fresh, [3, 10], src, [0, 1])
    with pytest.raises(IndexError):
        kvfile.copy_rows(fresh, [3, 4], src, [0, 6])
    assert not fresh.view(torch.uint8).any()
