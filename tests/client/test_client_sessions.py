"""Tests of the session file: location, mode 0600 and round trips."""

import os
import stat
from pathlib import Path

import pytest

from streamchat.client.errors import ClientError
from streamchat.client.sessions import SavedSession, SessionStore, private_file, state_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dir_follows_xdg_state_home_then_home():
    """$XDG_STATE_HOME/streamchat when set (and absolute), else ~/.local/state/streamchat."""
    assert state_dir({"XDG_STATE_HOME": "/x/state", "HOME": "/h"}) == Path("/x/state/streamchat")
    assert state_dir({"XDG_STATE_HOME": "relative", "HOME": "/h"}) == Path("/h/.local/state/streamchat")
    assert state_dir({"HOME": "/h"}) == Path("/h/.local/state/streamchat")


def test_saved_file_is_private_and_round_trips(tmp_path):
    """The file is created mode 0600 in a 0700 directory and reads back what was saved."""
    store = SessionStore(tmp_path / "state" / "streamchat" / "sessions.json")
    saved = SavedSession("sess_1", "tok_1", "ws://h/v1/realtime", "be brief", "hello",
                         created=100.0, last_used=200.0)
    old_umask = os.umask(0o022)
    try:
        store.save(saved)
    finally:
        os.umask(old_umask)
    assert mode(store.path) == 0o600
    assert mode(store.path.parent) == 0o700
    assert SessionStore(store.path).load() == [saved]
    assert [p.name for p in store.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_save_replaces_same_id_and_load_orders_by_last_use(tmp_path):
    """Saving an id again replaces its entry; load() lists the most recently used first."""
    store = SessionStore(tmp_path / "sessions.json")
    store.save(SavedSession("sess_a", "t1", last_used=1.0))
    store.save(SavedSession("sess_b", "t2", last_used=3.0))
    store.save(SavedSession("sess_a", "t3", last_used=2.0))
    assert [(s.id, s.resume_token) for s in store.load()] == [("sess_b", "t2"), ("sess_a", "t3")]


def test_touch_updates_fields_and_last_used(tmp_path):
    """touch() changes the given fields of a known session and marks it used; unknown ids give None."""
    store = SessionStore(tmp_path / "sessions.json")
    store.save(SavedSession("sess_a", "t1", last_used=1.0))
    updated = store.touch("sess_a", instructions="new")
    assert updated is not None and updated.instructions == "new" and updated.last_used > 1.0
    assert store.find("sess_a").instructions == "new"
    assert store.touch("sess_zz") is None


def test_find_by_id_or_unique_prefix(tmp_path):
    """find() takes a full id or an unambiguous prefix; an ambiguous prefix is an error."""
    store = SessionStore(tmp_path / "sessions.json")
    store.save(SavedSession("sess_abc", "t1"))
    store.save(SavedSession("sess_abd", "t2"))
    assert store.find("sess_abc").resume_token == "t1"
    assert store.find("sess_abd").resume_token == "t2"
    assert store.find("sess_x") is None
    with pytest.raises(ClientError, match="matches 2 sessions"):
        store.find("sess_ab")


def test_missing_file_is_empty_and_corrupt_file_is_reported(tmp_path):
    """No file means no sessions; a file that is not JSON names itself in the error."""
    store = SessionStore(tmp_path / "sessions.json")
    assert store.load() == []
    store.path.write_text("{not json")
    with pytest.raises(ClientError, match="cannot read the session file .*sessions.json"):
        store.load()


def test_private_file_tightens_an_existing_file(tmp_path):
    """private_file() leaves an existing file's text and sets mode 0600."""
    path = tmp_path / "history"
    path.write_text("kept")
    path.chmod(0o644)
    private_file(path)
    assert mode(path) == 0o600 and path.read_text() == "kept"
