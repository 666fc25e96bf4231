"""Tests of the tier moves on a tiny pool without a model: the placer decides, the pager copies and refuses bad files."""

import logging
import threading
import time

import pytest
import torch
from tierkit import VOCAB, layout, snapshot

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.engine.placement import Placer
from streamchat.engine.scheduler import SchedulerStats
from streamchat.engine.session import EngineSession, Residency
from streamchat.model.attention import LayerKV
from streamchat.tiers import kvfile
from streamchat.tiers.disk import DiskTier
from streamchat.tiers.host import HostTier
from streamchat.tiers.pager import Pager

DEVICE, HOST, DISK, DROPPED = Residency.DEVICE, Residency.HOST, Residency.DISK, Residency.DROPPED


def make_placer(tmp_path, num_blocks=12, host_blocks=4, disk=True, sync_io=True) -> Placer:
    lay = layout()
    pool = BlockPool(num_blocks)
    manager = KVCacheManager(pool, 16, 4, 64, b"test")
    gen = torch.Generator().manual_seed(0)
    caches = [LayerKV(torch.randn(num_blocks, 16, 3, 32, generator=gen).bfloat16(),
                      torch.randn(num_blocks, 16, 3, 32, generator=gen).bfloat16()) for _ in range(2)]
    host = HostTier(lay.kv_specs, host_blocks, torch.device("cpu")) if host_blocks else None
    pager = Pager(manager, caches, host, DiskTier(tmp_path, 1 << 30, lay, vocab_size=VOCAB) if disk else None)
    return Placer(manager, pager, {}, SchedulerStats(), sync_io)


def session(placer, sid, num_tokens, first=0, at=0.0):
    s = EngineSession("sess_" + sid * 32, placer.manager.new_seq(), last_active=at)
    placer.manager.append(s.seq, list(range(first, first + num_tokens)))
    placer.manager.commit(s.seq)
    placer.sessions[s.session_id] = s
    return s


def kv_of(placer, block_ids):
    return [t[block_ids].clone() for kv in placer.pager.kv for t in kv if t is not None]


def test_down_to_host_then_disk_and_back_bit_for_bit(tmp_path):
    """The host takes the first session; the second pushes it to disk; both come back with the same bytes."""
    placer = make_placer(tmp_path)
    pager = placer.pager
    a, b = session(placer, "a", 40), session(placer, "b", 40, first=500)
    kv_a, kv_b = kv_of(placer, a.seq.block_ids), kv_of(placer, b.seq.block_ids)
    assert placer.page_out(a) and a.residency is HOST and not a.resident and a.dropped_tokens == list(range(40))
    assert placer.page_out(b) and (a.residency, b.residency) == (DISK, HOST)
    assert placer.manager.pool.num_used == 0
    placer.check()
    pager.flush()
    for s, kv in ((a, kv_a), (b, kv_b)):
        placer.prefetch(s)
        assert s.resident and s.residency is DEVICE and not s.pending
        assert all(torch.equal(x, y) for x, y in zip(kv_of(placer, s.seq.block_ids), kv))
    assert pager.moves == {**pager.moves, (DEVICE, HOST): 2, (HOST, DISK): 1, (DISK, DEVICE): 1, (HOST, DEVICE): 1}
    placer.manager.check([a.seq, b.seq])
    placer.check()
    pager.close()


def test_blocks_copied_in_are_found_by_the_hashes_a_prefill_gives(tmp_path):
    """A page-in that copies a pristine session's blocks registers each full one under the chain hash
    its prefill registered, so a later session with the same prefix shares them."""
    placer = make_placer(tmp_path)
    manager, pool = placer.manager, placer.manager.pool
    a = session(placer, "a", 40)
    hashes = list(a.seq.block_hashes)
    assert len(hashes) == 2
    assert placer.page_out(a) and placer.page_out(session(placer, "b", 40, first=500))  # a on to disk
    fillers = [session(placer, k, n, first=2000 + 100 * i) for i, (k, n) in enumerate(zip("fghi", (48, 48, 48, 32)))]
    assert pool.num_free == 0  # every block taken: a's cached copies are gone
    assert all(pool.lookup(h, tuple(range(i * 16, i * 16 + 16))) is None for i, h in enumerate(hashes))
    for f in fillers:
        manager.free(f.seq)
        del placer.sessions[f.session_id]
    placer.pager.flush()
    placer.prefetch(a)
    assert a.residency is DEVICE and a.seq.block_hashes == hashes
    for i, h in enumerate(hashes):
        assert pool.lookup(h, tuple(range(i * 16, i * 16 + 16))) == a.seq.block_ids[i]
    c = manager.new_seq()  # a new session with the same tokens takes a's full blocks
    assert manager.match_prefix(c, list(range(40))) == 32 and c.block_ids == a.seq.block_ids[:2]
    manager.check([a.seq, c])
    placer.check()
    placer.pager.close()


def test_a_page_in_without_room_rebuilds_from_tokens_and_frees_the_host_copy(tmp_path):
    """No device room for a host page-in (every block held by busy sessions): the session is rebuilt from
    its tokens instead, its host copy let go; nothing leaks."""
    placer = make_placer(tmp_path, num_blocks=5)
    a = session(placer, "a", 40)
    placer.page_out(a)
    busy = session(placer, "b", 60, first=500)
    busy.pending.append(object())  # busy: never a victim
    placer.prefetch(a)
    assert a.residency is DEVICE and a.seq.num_tokens == 0 and list(a.pending[0].token_ids) == list(range(40))
    assert placer.pager.host.pool.num_used == 0
    placer.check()


def test_the_session_coming_up_keeps_its_host_copy_while_room_is_made(tmp_path):
    """Making room for a host page-in pages others out; the host's oldest go to disk, never the session
    coming up (its copy is what lands)."""
    placer = make_placer(tmp_path, num_blocks=7, host_blocks=6)
    a, b = session(placer, "a", 40, at=1.0), session(placer, "b", 40, first=500, at=2.0)
    kv_a = kv_of(placer, a.seq.block_ids)
    assert placer.page_out(a) and placer.page_out(b) and (a.residency, b.residency) == (HOST, HOST)
    c = session(placer, "c", 60, first=900, at=3.0)  # takes 4 of 6 device blocks
    placer.prefetch(a)  # a needs 3: c goes down; for its 4 the host's oldest but a (b) goes to disk, then c too
    assert (a.residency, b.residency, c.residency) == (DEVICE, DISK, DISK)
    assert all(torch.equal(x, y) for x, y in zip(kv_of(placer, a.seq.block_ids), kv_a))
    placer.check()
    placer.pager.close()


@pytest.mark.parametrize("damage,reason", [("flip", "checksum"), ("truncate", "truncated"),
                                           ("foreign", "foreign"), ("tokens", "inconsistent"),
                                           ("delete", "missing")])
def test_a_bad_file_on_page_in_is_logged_counted_and_rebuilt_from_tokens(tmp_path, caplog, damage, reason):
    """A damaged or missing file is refused with a WARNING naming the reason; the session is rebuilt from
    its tokens."""
    placer = make_placer(tmp_path, host_blocks=0)
    pager = placer.pager
    a = session(placer, "a", 40)
    assert placer.page_out(a) and a.residency is DISK
    pager.flush()
    path = pager.disk.path(a.session_id)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "foreign":  # the same session, saved by a daemon with another model
        other = layout(model_fingerprint="fp-other")
        kvfile.write_atomic(path, snapshot(other, a.session_id), other)
    elif damage == "tokens":
        a.dropped_tokens[3] += 1
    else:
        path.unlink()
    tokens = list(a.dropped_tokens)
    with caplog.at_level(logging.WARNING, logger="streamchat.engine.placement"):
        placer.prefetch(a)
    assert f"saved KV not used ({reason}" in caplog.text and a.session_id in caplog.text
    assert pager.load_failures[reason] == 1 and a.residency is DEVICE and list(a.pending[0].token_ids) == tokens
    pager.close()


def test_a_file_read_off_the_loop_lands_only_when_taken(tmp_path):
    """sync_io off (the engine core): a disk session's file is read on the reader thread; the session stays on
    disk, loading, until `take_loads` lands it between steps."""
    placer = make_placer(tmp_path, host_blocks=0, sync_io=False)
    woken, readers = [], []
    placer.notify = lambda: woken.append(1)
    disk = placer.pager.disk
    load = disk.load
    disk.load = lambda *a, **k: (readers.append(threading.current_thread().name), load(*a, **k))[1]
    a = session(placer, "a", 40)
    kv_a = kv_of(placer, a.seq.block_ids)
    placer.page_out(a)
    placer.pager.flush()
    placer.prefetch(a)
    assert a.loading and a.residency is DISK and placer.reading
    placer.check()
    for _ in range(200):
        if woken:
            break
        time.sleep(0.01)
    assert woken and placer.take_loads() == 1
    # the file was read and checked off the calling thread: by the idle reader, or (on a machine too busy
    # to give it a moment for 0.5 s) by its rescuer as well
    assert readers and set(readers) <= {"streamchat-disk-reader-idle", "streamchat-disk-reader-rescue"}
    assert a.resident and not a.loading and not placer.reading
    assert all(torch.equal(x, y) for x, y in zip(kv_of(placer, a.seq.block_ids), kv_a))
    placer.check()
    placer.pager.close()


def test_no_tier_with_room_means_no_move(tmp_path):
    """Without a disk and with a host too small for the session, page_out refuses and changes nothing."""
    placer = make_placer(tmp_path, host_blocks=2, disk=False)
    a = session(placer, "a", 40)
    blocks = list(a.seq.block_ids)
    assert not placer.page_out(a)
    assert a.resident and a.residency is DEVICE and a.seq.block_ids == blocks
    placer.check()
