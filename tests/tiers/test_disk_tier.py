"""Tests of the disk tier: file names, LRU deletion within the budget, temp files, kill -9 mid-write."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tierkit import SID as SNAPSHOT_SID
from tierkit import VOCAB, layout, same_bytes, snapshot

from streamchat.config import ConfigError
from streamchat.tiers import datadir, kvfile
from streamchat.tiers import disk as disk_module
from streamchat.tiers.disk import DiskTier, default_data_dir, file_name
from streamchat.tiers.kvfile import KVFileError

SID = ["sess_" + f"{i:032x}" for i in range(6)]


class Clock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self):
        self.now += 10
        return self.now


def test_file_names_never_come_from_client_input_unchecked():
    """Server-made ids name their file; anything else is hashed, so no path can escape the directory."""
    assert file_name(SID[1]) == SID[1] + ".safetensors"
    for sid in ("../../etc/passwd", "sess_" + "AB" * 16, "sess_x/../../y", "", "a" * 10_000):
        name = file_name(sid)
        assert name.startswith("h") and len(name) == 1 + 32 + len(".safetensors") and "/" not in name
    assert file_name("x") != file_name("y")


def test_default_data_dir_sits_next_to_the_sqlite_file(monkeypatch, tmp_path):
    """sqlite:///dir/s.db -> dir/s.kv; other databases -> $XDG_DATA_HOME/streamchat/kv."""
    assert default_data_dir(f"sqlite:///{tmp_path}/s.db") == tmp_path / "s.kv"
    assert default_data_dir("sqlite:///streamchat.db") == Path("streamchat.kv")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir("postgresql://u@h/db") == tmp_path / "streamchat" / "kv"
    assert default_data_dir("sqlite:///:memory:") == tmp_path / "streamchat" / "kv"


def test_saves_load_back_from_memory_then_disk(tmp_path):
    """A queued snapshot loads at once; once flushed it is a file that loads bit for bit."""
    lay = layout()
    disk = DiskTier(tmp_path, 1 << 30, lay, vocab_size=VOCAB)
    snap = snapshot(lay, SID[0])
    assert disk.save(snap, version=3)
    assert disk.load(SID[0]) is snap or same_bytes(disk.load(SID[0]).tensors, snap.tensors)
    disk.flush()
    assert disk.copy_of(SID[0]).version == 3 and disk.num_files == 1 and disk.num_writes == 1
    assert same_bytes(disk.load(SID[0], mark="m1").tensors, snap.tensors)
    with pytest.raises(KVFileError, match="stale"):
        disk.load(SID[0], mark="other")
    disk.delete(SID[0])
    assert disk.copy_of(SID[0]) is None and session_files(tmp_path) == []
    disk.close()


def test_budget_deletes_least_recently_used_files(tmp_path):
    """Over its budget the directory loses the file used longest ago; a load counts as a use."""
    lay = layout()
    clock = Clock()
    size = len(_file_bytes(tmp_path, lay))
    disk = DiskTier(tmp_path / "kv", int(size * 3.5), lay, vocab_size=VOCAB, clock=clock)
    for sid in SID[:3]:
        disk.save(snapshot(lay, sid))
        disk.flush()
    disk.load(SID[0])  # now the most recently used
    disk.save(snapshot(lay, SID[3]))
    disk.flush()
    assert session_files(tmp_path / "kv") == sorted(file_name(s) for s in (SID[0], SID[2], SID[3]))
    assert disk.num_deletions == 1 and disk.num_bytes <= disk.budget
    assert not disk.save(snapshot(lay, SID[4], num_tokens=240))  # alone over the budget: refused
    disk.close()
    reopened = DiskTier(tmp_path / "kv", int(size * 2.5), lay, vocab_size=VOCAB, clock=clock)  # a smaller budget
    assert session_files(tmp_path / "kv") == sorted(file_name(s) for s in (SID[0], SID[3]))
    assert reopened.num_files == 2
    reopened.close()


def session_files(folder):
    """The names in `folder` besides the marker."""
    return sorted(p.name for p in folder.iterdir() if p.name != datadir.MARKER)


def _file_bytes(tmp_path, lay):
    path = tmp_path / "probe.safetensors"
    kvfile.write_atomic(path, snapshot(lay), lay)
    data = path.read_bytes()
    path.unlink()
    return data


def test_unwritable_data_dir_is_a_config_error(tmp_path):
    """A data directory that cannot be written is refused at start with a clear error."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="data_dir"):
        DiskTier(tmp_path / "file" / "kv", 1 << 30, layout(), vocab_size=VOCAB)


WRITER = """
import sys
sys.path.insert(0, {tests!r})
from tierkit import layout, snapshot
from streamchat.tiers import kvfile
from pathlib import Path
lay, path = layout(), Path({path!r})
snaps = [snapshot(lay, num_tokens=60, seed=s) for s in range(2)]
print("ready", flush=True)
i = 0
while True:
    kvfile.write_atomic(path, snaps[i % 2], lay)
    i += 1
"""


def test_kill9_in_the_middle_of_writes_leaves_a_whole_file_or_none(tmp_path, caplog, monkeypatch):
    """kill -9 a process while it rewrites a session file: the file is whole; the temp file is removed on start
    (once stale: here at once; a young one may be another daemon's write, see test_data_dir)."""
    monkeypatch.setattr(disk_module, "STALE_TEMP_S", -1.0)
    path = tmp_path / "kv" / (SNAPSHOT_SID + ".safetensors")  # the writer's snapshots are that session's
    lay = layout()
    DiskTier(path.parent, 1 << 30, lay, vocab_size=VOCAB).close()  # claims the new folder
    caught_mid_write = 0
    for attempt in range(20):
        child = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(Path(__file__).parent),
                                                                       path=str(path))],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not list(path.parent.glob("*.tmp")) and time.monotonic() < deadline:
            pass
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        temps = list(path.parent.glob("*.tmp"))
        caught_mid_write += bool(temps)
        if path.exists():
            snap = kvfile.read(path, lay, SNAPSHOT_SID, vocab_size=VOCAB)  # whole, whatever moment the kill came
            assert snap.state.token_ids in ([(7 * i) % 1000 for i in range(60)],
                                            [(7 * i + 1) % 1000 for i in range(60)])
        with caplog.at_level(logging.WARNING, logger="streamchat.tiers.disk"):
            DiskTier(path.parent, 1 << 30, lay, vocab_size=VOCAB).close()
        assert not list(path.parent.glob("*.tmp"))
        if temps:
            assert "half-written" in caplog.text
            break
    assert caught_mid_write, "never killed the writer mid-write"
