"""Tests of the tier policy on a tiny pool without a model: where sessions go, what comes back, refusals logged."""

import logging

import pytest
import torch
from tierkit import VOCAB, layout, snapshot

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.engine.session import EngineSession
from streamchat.model.attention import LayerKV
from streamchat.tiers import kvfile
from streamchat.tiers.disk import DiskTier
from streamchat.tiers.host import HostTier
from streamchat.tiers.pager import Pager


def make_pager(tmp_path, num_blocks=12, host_blocks=4, disk=True):
    lay = layout()
    pool = BlockPool(num_blocks)
    manager = KVCacheManager(pool, 16, 4, 64, b"test")
    gen = torch.Generator().manual_seed(0)
    caches = [LayerKV(torch.randn(num_blocks, 16, 3, 32, generator=gen).bfloat16(),
                      torch.randn(num_blocks, 16, 3, 32, generator=gen).bfloat16()) for _ in range(2)]
    host = HostTier(lay.kv_specs, host_blocks, torch.device("cpu")) if host_blocks else None
    return Pager(manager, caches, host, DiskTier(tmp_path, 1 << 30, lay, vocab_size=VOCAB) if disk else None)


def session(pager, sid, num_tokens, first=0):
    s = EngineSession("sess_" + sid * 32, pager.manager.new_seq())
    pager.manager.append(s.seq, list(range(first, first + num_tokens)))
    pager.manager.commit(s.seq)
    return s


def kv_of(pager, block_ids):
    return [t[block_ids].clone() for kv in pager.kv for t in kv if t is not None]


def room(pager):
    return lambda n: pager.manager.pool.num_free >= n


def test_down_to_host_then_disk_and_back_bit_for_bit(tmp_path):
    """The host takes the first session; the second pushes it to disk; both come back with the same bytes."""
    pager = make_pager(tmp_path)
    a, b = session(pager, "a", 40), session(pager, "b", 40, first=500)
    kv_a, kv_b = kv_of(pager, a.seq.block_ids), kv_of(pager, b.seq.block_ids)
    assert pager.page_out(a) and a.tier == "host" and not a.resident and a.dropped_tokens == list(range(40))
    assert pager.page_out(b) and (a.tier, b.tier) == ("disk", "host")
    assert pager.manager.pool.num_used == 0
    pager.check([a, b])
    pager.flush()
    for s, kv in ((a, kv_a), (b, kv_b)):
        assert pager.page_in(s, room(pager)) and s.resident and s.tier == "device"
        assert all(torch.equal(x, y) for x, y in zip(kv_of(pager, s.seq.block_ids), kv))
    assert pager.moves == {**pager.moves, ("device", "host"): 2, ("host", "disk"): 1,
                           ("disk", "device"): 1, ("host", "device"): 1}
    pager.manager.check([a.seq, b.seq])
    pager.check([a, b])
    pager.close()


def test_page_in_without_room_leaves_the_session_where_it_was(tmp_path):
    """No device room: page_in says False, the host copy stays, nothing leaks."""
    pager = make_pager(tmp_path)
    a = session(pager, "a", 40)
    pager.page_out(a)
    assert not pager.page_in(a, lambda n: False)
    assert a.tier == "host" and pager.manager.pool.num_used == 0
    pager.check([a])
    assert pager.page_in(a, room(pager))
    pager.close()


@pytest.mark.parametrize("damage,reason", [("flip", "checksum"), ("truncate", "truncated"),
                                           ("foreign", "foreign"), ("tokens", "inconsistent"),
                                           ("delete", "missing")])
def test_a_bad_file_on_page_in_is_logged_counted_and_dropped_to_tokens(tmp_path, caplog, damage, reason):
    """A damaged or missing file is refused with a WARNING naming the reason; the session keeps its tokens."""
    pager = make_pager(tmp_path, host_blocks=0)
    a = session(pager, "a", 40)
    assert pager.page_out(a) and a.tier == "disk"
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
    with caplog.at_level(logging.WARNING, logger="streamchat.tiers.pager"):
        assert not pager.page_in(a, room(pager))
    assert f"saved KV not used ({reason}" in caplog.text and a.session_id in caplog.text
    assert pager.load_failures[reason] == 1 and a.tier == "dropped" and a.dropped_tokens
    pager.close()


def test_no_tier_with_room_means_no_move(tmp_path):
    """Without a disk and with a host too small for the session, page_out refuses and changes nothing."""
    pager = make_pager(tmp_path, host_blocks=2, disk=False)
    a = session(pager, "a", 40)
    blocks = list(a.seq.block_ids)
    assert not pager.page_out(a)
    assert a.resident and a.tier == "device" and a.seq.block_ids == blocks
    pager.check([a])
