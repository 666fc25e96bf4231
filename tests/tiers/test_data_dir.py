"""Tests of the data directory: claimed only when new or empty, private, and only the daemon's own files touched."""

import json
import logging
import os
import time
import stat

import pytest
from tierkit import VOCAB, layout, snapshot

from streamchat.config import ConfigError
from streamchat.tiers import datadir
from streamchat.tiers.disk import DiskTier, file_name

SID = ["sess_" + f"{i:032x}" for i in range(4)]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def open_tier(root, budget=1 << 30) -> DiskTier:
    return DiskTier(root, budget, layout(), vocab_size=VOCAB)


def test_a_new_folder_is_created_private_with_the_marker(tmp_path):
    """A missing data dir is made 0700 with a 0600 marker naming the format; session files are 0600."""
    root = tmp_path / "a" / "kv"
    disk = open_tier(root)
    disk.save(snapshot(layout(), SID[0]))
    disk.close()
    marker = json.loads((root / datadir.MARKER).read_text())
    assert (marker["format"], marker["version"], type(marker["created_at"])) == ("streamchat.data-dir", 1, float)
    assert mode(root) == 0o700 and mode(root / datadir.MARKER) == 0o600 and mode(root / file_name(SID[0])) == 0o600
    assert sorted(os.listdir(root)) == [datadir.MARKER, file_name(SID[0])]


def test_an_empty_folder_is_adopted_and_made_private(tmp_path):
    """An existing empty folder (here 0755) is claimed: mode 0700 and the marker written."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    open_tier(root).close()
    assert mode(root) == 0o700 and os.listdir(root) == [datadir.MARKER]


def test_a_non_empty_folder_without_the_marker_is_refused_untouched(tmp_path):
    """A folder holding anything, and no marker, is refused at start naming it and what to do; nothing changes."""
    root = tmp_path / "home"
    root.mkdir()
    (root / "thesis.safetensors").write_bytes(b"precious")
    (root / (SID[1] + ".safetensors")).write_bytes(b"looks like ours")
    os.chmod(root, 0o755)
    with pytest.raises(ConfigError) as err:
        open_tier(root)
    message = str(err.value)
    assert message.startswith(f"data_dir {root} is not empty (sess_{1:032x}.safetensors, thesis.safetensors) "
                              f"and has no {datadir.MARKER} file")
    assert "pass --data-dir naming a new or empty folder" in message
    assert f"`touch {root / datadir.MARKER}`" in message
    assert sorted(os.listdir(root)) == [SID[1] + ".safetensors", "thesis.safetensors"] and mode(root) == 0o755
    (root / datadir.MARKER).touch()  # what the message says to do for an earlier streamchat's files
    disk = open_tier(root)
    assert disk.num_files == 1 and disk.copy_of(SID[1]).size == len(b"looks like ours")
    disk.close()


def test_a_marker_that_is_not_a_file_is_refused(tmp_path):
    """A marker that is a link (or a directory) does not claim the folder."""
    root = tmp_path / "kv"
    root.mkdir()
    (root / datadir.MARKER).symlink_to(tmp_path)
    with pytest.raises(ConfigError, match=f"{datadir.MARKER} is not a regular file"):
        open_tier(root)


def test_only_the_daemons_own_files_are_indexed_counted_or_deleted(tmp_path, caplog):
    """Other files, look-alike names, links and folders are never indexed, counted or deleted, even over
    the budget, and are logged once; a temp file of the daemon's is removed once it is old (a young one may
    be another daemon's write in progress: a fleet shares the folder)."""
    root = tmp_path / "kv"
    open_tier(root).close()
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x" * 10_000)
    foreign = {"notes.txt": b"mine", "model.safetensors": b"y" * 10_000, "sess_abc.safetensors": b"z",
               "H" + "0" * 32 + ".safetensors": b"z", ".backup.tmp": b"t", ".sess_x.safetensors.0badc0de.tmp": b"t"}
    for name, data in foreign.items():
        (root / name).write_bytes(data)
    (root / (SID[2] + ".safetensors")).symlink_to(outside)
    (root / ("h" + "1" * 32 + ".safetensors")).mkdir()
    temp = root / f".{SID[3]}.safetensors.0123abcd.tmp"
    temp.write_bytes(b"half")
    os.utime(temp, (time.time() - 3600,) * 2)
    young = root / f".{SID[3]}.safetensors.4567cdef.tmp"  # another daemon's write in progress: kept
    young.write_bytes(b"half")
    size = len(_one_file(tmp_path))
    with caplog.at_level(logging.INFO, logger="streamchat.tiers.disk"):
        disk = open_tier(root, budget=int(size * 1.5))
    assert (disk.num_files, disk.num_bytes) == (0, 0) and not temp.exists()
    for sid in SID[:2]:
        disk.save(snapshot(layout(), sid))
        disk.flush()
    assert (disk.num_deletions, disk.num_files) == (1, 1)
    assert disk.num_bytes == (root / file_name(SID[1])).stat().st_size
    disk.close()
    left = {p.name for p in root.iterdir()}
    assert left == {*foreign, SID[2] + ".safetensors", "h" + "1" * 32 + ".safetensors", datadir.MARKER,
                    file_name(SID[1]), young.name}
    assert all((root / name).read_bytes() == data for name, data in foreign.items()) and outside.exists()
    notes = [r.getMessage() for r in caplog.records if "not streamchat session files" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith(f"disk tier {root}: 8 entries are not streamchat session files")
    assert "removing half-written session file " + temp.name in caplog.text


def test_a_marked_folder_open_to_others_is_warned_about(tmp_path, caplog):
    """A claimed folder someone opened up (0755) is used, with a warning saying how to close it."""
    root = tmp_path / "kv"
    open_tier(root).close()
    os.chmod(root, 0o755)
    with caplog.at_level(logging.WARNING, logger="streamchat.tiers.disk"):
        open_tier(root).close()
    assert f"data_dir {root} has mode 755: others may read saved sessions; chmod 700 {root}" in caplog.text


def test_temp_names_of_writes_are_the_daemons(tmp_path, monkeypatch):
    """A write's temp file is named as TEMP_FILE expects, so a cut-short write is cleaned up on start."""
    from streamchat.tiers import kvfile

    seen = []
    real = os.replace
    monkeypatch.setattr(kvfile.os, "replace", lambda src, dst: seen.append(os.path.basename(src)) or real(src, dst))
    _one_file(tmp_path)
    assert len(seen) == 1 and datadir.TEMP_FILE.fullmatch(seen[0])


def _one_file(tmp_path) -> bytes:
    from streamchat.tiers import kvfile

    path = tmp_path / (SID[0] + ".safetensors")
    kvfile.write_atomic(path, snapshot(layout(), SID[0]), layout())
    data = path.read_bytes()
    path.unlink()
    return data
