"""Tests of the read buffers: memory is used again only once nothing views it, and the kept total is bounded."""

import gc

import torch
from tierkit import SID, VOCAB, layout, same_bytes, snapshot

from streamchat.tiers import buffers, kvfile
from streamchat.tiers.buffers import ROUND, ReadBuffers


def test_a_freed_buffer_is_used_again_for_a_read_that_fits():
    rb = ReadBuffers()
    t = rb.take(3000)
    assert t.dtype == torch.uint8 and t.shape == (3000,)
    first = t.data_ptr()
    del t
    again = rb.take(2000)  # smaller: fits the buffer just freed
    assert again.data_ptr() == first and again.shape == (2000,)
    assert (rb.made, rb.reused) == (1, 1)
    del again
    bigger = rb.take(ROUND + 1)  # does not fit the 1 MiB buffer: a new one
    assert bigger.data_ptr() != first and (rb.made, rb.reused) == (2, 1)


def test_a_buffer_is_not_used_again_while_any_view_of_it_lives():
    """A snapshot's tensors are dtype views and strided views of the buffer: while one lives,
    a new read gets other memory and the old bytes stay as they were."""
    rb = ReadBuffers()
    t = rb.take(4096)
    t.fill_(7)
    view = t[:1024].view(torch.int32).as_strided((16, 4), (4, 1), 8)
    del t
    gc.collect()
    other = rb.take(4096)
    other.fill_(9)
    assert bool((view == 0x07070707).all()) and rb.reused == 0
    first = view.untyped_storage().data_ptr()
    del view, other  # both back: the older first
    assert rb.take(4096).data_ptr() == first and rb.reused == 1


def test_free_buffers_kept_are_bounded_oldest_leaving_first():
    rb = ReadBuffers(keep_bytes=2 * ROUND)
    held = [rb.take(ROUND) for _ in range(3)]
    ptrs = [t.data_ptr() for t in held]
    while held:
        held.pop(0)  # given back in the order taken
    assert rb.free_bytes() == 2 * ROUND  # three came back; the oldest was let go
    again = [rb.take(ROUND), rb.take(ROUND)]
    assert [t.data_ptr() for t in again] == ptrs[1:] and rb.free_bytes() == 0
    del again
    huge = rb.take(3 * ROUND)
    del huge
    assert rb.free_bytes() == 0  # larger than keep_bytes: never kept


def test_reading_a_file_again_neither_overwrites_a_snapshot_in_use_nor_faults_in_new_memory(tmp_path, monkeypatch):
    rb = ReadBuffers()
    monkeypatch.setattr(buffers, "READ_BUFFERS", rb)
    monkeypatch.setattr("streamchat.tiers.kvread.READ_BUFFERS", rb)
    lay = layout(kv_dtype="int8")
    snap = snapshot(lay)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    kvfile.write_atomic(a, snap, lay)
    other = snapshot(lay, seed=1)
    kvfile.write_atomic(b, other, lay)
    kept = kvfile.read(a, lay, SID, vocab_size=VOCAB)
    second = kvfile.read(b, lay, other.session_id, vocab_size=VOCAB)
    assert same_bytes(kept.tensors, snap.tensors) and same_bytes(second.tensors, other.tensors)
    assert rb.reused == 0
    del second
    third = kvfile.read(b, lay, other.session_id, vocab_size=VOCAB)
    assert rb.reused == 1 and same_bytes(third.tensors, other.tensors) and same_bytes(kept.tensors, snap.tensors)
