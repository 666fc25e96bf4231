"""Tests of streamchat.store.store and .tokens: sessions, items, durability, resume tokens, a model check.

Every test taking `url` (or `store`) runs on SQLite and on PostgreSQL (tests/store/conftest.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import subprocess
import sys
import textwrap
import uuid

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from streamchat.store import (
    DuplicateId,
    ItemNotOpen,
    SessionRecord,
    Store,
    StoreError,
    UnknownItem,
    UnknownSession,
    hash_token,
    new_resume_token,
    verify_token,
)

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def ticking_clock(start: dt.datetime = T0):
    """A clock that advances one second per call, so timestamps are exact."""
    ticks = itertools.count()
    return lambda: start + dt.timedelta(seconds=next(ticks))


@pytest.fixture
def store(url: str):
    s = Store(url, clock=ticking_clock())
    s.migrate()
    yield s
    s.close()


def _summary(store: Store, session_id: str) -> list[tuple]:
    return [(r.seq, r.item_id, r.role, r.kind, r.text, r.num_tokens, r.status) for r in store.items(session_id)]


# -- sessions -------------------------------------------------------------


def test_session_round_trip(store: Store) -> None:
    """A created session reads back exactly, with zero counters and aware UTC times."""
    store.create_session("sess_a", hash_token("tok"), "be brief", {"max_output_tokens": 64, "sink": 4})
    assert store.get_session("sess_a") == SessionRecord(
        id="sess_a",
        token_hash=hash_token("tok"),
        instructions="be brief",
        settings={"max_output_tokens": 64, "sink": 4},
        total_tokens=0,
        evicted_tokens=0,
        num_items=0,
        created_at=T0,
        last_active_at=T0,
        status="active",
    )


def test_update_session(store: Store) -> None:
    """update_session replaces only the given fields and bumps last_active_at."""
    store.create_session("sess_a", "h", "old", {"window": 8})
    store.update_session("sess_a", settings={"window": 16}, total_tokens=40, evicted_tokens=8)
    store.update_session("sess_a", status="closed")
    record = store.get_session("sess_a")
    assert (record.instructions, record.settings, record.status) == ("old", {"window": 16}, "closed")
    assert (record.total_tokens, record.evicted_tokens) == (40, 8)
    assert (record.created_at, record.last_active_at) == (T0, T0 + dt.timedelta(seconds=2))


def test_timestamps_normalised_to_utc(url: str) -> None:
    """A clock in another zone is stored and read back as the same instant in UTC."""
    plus_two = dt.timezone(dt.timedelta(hours=2))
    with Store(url, clock=lambda: dt.datetime(2025, 1, 1, 2, tzinfo=plus_two)) as s:
        s.migrate()
        s.create_session("sess_a", "h", "", {})
        created = s.get_session("sess_a").created_at
    assert created == T0 and created.tzinfo == dt.timezone.utc


def test_list_sessions_most_recent_first(store: Store) -> None:
    """list_sessions orders by last activity, newest first, and honours the limit."""
    for name in ("sess_a", "sess_b", "sess_c"):
        store.create_session(name, "h", "", {})
    store.update_session("sess_a")
    assert [r.id for r in store.list_sessions()] == ["sess_a", "sess_c", "sess_b"]
    assert [r.id for r in store.list_sessions(limit=1)] == ["sess_a"]


def test_duplicate_session_id_refused(store: Store) -> None:
    """A second session with a taken id raises DuplicateId (a server bug, not a store failure) and changes nothing."""
    store.create_session("sess_a", "h", "first", {})
    with pytest.raises(DuplicateId, match="session 'sess_a' already exists"):
        store.create_session("sess_a", "h", "second", {})
    assert store.get_session("sess_a").instructions == "first"


def test_duplicate_item_id_refused(store: Store) -> None:
    """A second item with a taken id in one session raises StoreError item_id_in_use; other sessions may reuse it."""
    store.create_session("sess_a", "h", "", {})
    store.create_session("sess_b", "h", "", {})
    store.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
    with pytest.raises(StoreError) as info:
        store.add_item("sess_a", "item_1", "user", "message", "again", "completed", 1)
    assert info.value.code == "item_id_in_use"
    assert _summary(store, "sess_a") == [(0, "item_1", "user", "message", "hi", 1, "completed")]
    assert store.get_session("sess_a").num_items == 1
    assert store.add_item("sess_b", "item_1", "user", "message", "hi", "completed", 1).seq == 0


# -- items ----------------------------------------------------------------


def test_items_in_seq_order(store: Store) -> None:
    """Items get seq 0, 1, 2 in insertion order and bump the session's num_items."""
    store.create_session("sess_a", "h", "sys", {})
    first = store.add_item("sess_a", "item_1", "user", "message", "hello", "completed", 2)
    store.add_item("sess_a", "item_2", "user", "append", " more", "completed", 1)
    store.add_item("sess_a", "item_3", "assistant", "response", "", "in_progress", 0)
    assert (first.seq, first.created_at, first.updated_at) == (0, T0 + dt.timedelta(seconds=1), first.created_at)
    assert _summary(store, "sess_a") == [
        (0, "item_1", "user", "message", "hello", 2, "completed"),
        (1, "item_2", "user", "append", " more", 1, "completed"),
        (2, "item_3", "assistant", "response", "", 0, "in_progress"),
    ]
    assert store.get_session("sess_a").num_items == 3
    assert store.get_session("sess_a").last_active_at == T0 + dt.timedelta(seconds=3)
    assert store.session_with_items("sess_a") == (store.get_session("sess_a"), store.items("sess_a"))
    assert store.take_session("sess_a", "d1", 15, lambda r: True)[1:] == store.session_with_items("sess_a")
    store.create_session("sess_b", "h", "", {})
    assert store.session_with_items("sess_b") == (store.get_session("sess_b"), [])
    assert store.take_session("sess_b", "d1", 15, lambda r: True)[1:] == (store.get_session("sess_b"), [])


def test_append_text_concatenates(store: Store) -> None:
    """append_text concatenates raw text (any characters) and sums the token counts."""
    store.create_session("sess_a", "h", "", {})
    store.add_item("sess_a", "item_1", "assistant", "response", "He", "in_progress", 1)
    for piece in ("llo", ", wörld", "\x00 ", "🙂"):
        store.append_text("sess_a", "item_1", piece, 1)
    assert _summary(store, "sess_a") == [(0, "item_1", "assistant", "response", "Hello, wörld\x00 🙂", 5, "in_progress")]


def test_any_character_anywhere(store: Store) -> None:
    """Ids, instructions and text keep NUL and U+0001 exactly; pieces appended one by one never merge into an escape."""
    sid, iid = "sess_\x00\x01", "item_\x01\x00\x010"
    store.create_session(sid, "h", "sys\x00\x01", {"stop": ["\x00"]})
    store.add_item(sid, iid, "assistant", "response", "\x01", "in_progress", 1)
    for piece in ("0", "\x00", "\x01", "\x01", "0"):
        store.append_text(sid, iid, piece, 1)
    record = store.get_session(sid)
    assert (record.id, record.instructions, record.settings) == (sid, "sys\x00\x01", {"stop": ["\x00"]})
    assert _summary(store, sid) == [(0, iid, "assistant", "response", "\x010\x00\x01\x010", 6, "in_progress")]
    assert [r.id for r in store.list_sessions()] == [sid]


def test_item_ids_as_long_as_the_protocol_allows(store: Store) -> None:
    """A 256-character client item id (the protocol's limit) is stored and found; 0002 lifts PostgreSQL's 128."""
    long_id = "i" * 255 + "\x00"
    store.create_session("sess_a", "h", "", {})
    store.add_item("sess_a", long_id, "user", "append", "a", "in_progress", 1)
    store.finish_item("sess_a", long_id, status="completed")
    assert _summary(store, "sess_a") == [(0, long_id, "user", "append", "a", 1, "completed")]
    with pytest.raises(StoreError, match="already exists"):
        store.add_item("sess_a", long_id, "user", "message", "", "completed", 0)


def test_finish_item_closes_it(store: Store) -> None:
    """finish_item sets the final status, text and count; the item then refuses text."""
    store.create_session("sess_a", "h", "", {})
    store.add_item("sess_a", "item_1", "assistant", "response", "par", "in_progress", 1)
    store.finish_item("sess_a", "item_1", text="partial", status="incomplete", num_tokens=2)
    assert _summary(store, "sess_a") == [(0, "item_1", "assistant", "response", "partial", 2, "incomplete")]
    with pytest.raises(ItemNotOpen):
        store.append_text("sess_a", "item_1", "more", 1)
    with pytest.raises(ItemNotOpen):
        store.finish_item("sess_a", "item_1", status="completed")


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.update_session("sess_x", status="closed"),
        lambda s: s.add_item("sess_x", "item_1", "user", "message", "", "completed", 0),
        lambda s: s.append_text("sess_x", "item_1", "a", 1),
        lambda s: s.finish_item("sess_x", "item_1", status="completed"),
        lambda s: s.items("sess_x"),
        lambda s: s.session_with_items("sess_x"),
        lambda s: s.take_session("sess_x", "d1", 15, lambda r: True),
    ],
)
def test_unknown_session_raises(store: Store, call) -> None:
    """Every call naming a missing session raises UnknownSession, a KeyError."""
    with pytest.raises(UnknownSession, match="unknown session 'sess_x'") as info:
        call(store)
    assert isinstance(info.value, KeyError)
    assert store.get_session("sess_x") is None


def test_unknown_item_raises(store: Store) -> None:
    """Appending to or finishing a missing item of a real session raises UnknownItem."""
    store.create_session("sess_a", "h", "", {})
    with pytest.raises(UnknownItem):
        store.append_text("sess_a", "item_x", "a", 1)
    with pytest.raises(UnknownItem):
        store.finish_item("sess_a", "item_x", status="failed")


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.add_item("sess_a", "i", "robot", "message", "", "completed", 0),
        lambda s: s.add_item("sess_a", "i", "user", "note", "", "completed", 0),
        lambda s: s.add_item("sess_a", "i", "user", "message", "", "done", 0),
        lambda s: s.add_item("sess_a", "i", "user", "message", "", "completed", -1),
        lambda s: s.finish_item("sess_a", "i", status="in_progress"),
        lambda s: s.update_session("sess_a", status="paused"),
    ],
)
def test_bad_values_raise(store: Store, call) -> None:
    """Words outside the allowed sets and negative counts raise ValueError."""
    store.create_session("sess_a", "h", "", {})
    with pytest.raises(ValueError):
        call(store)


def test_records_are_frozen(store: Store) -> None:
    """Records are frozen snapshots, not live ORM objects."""
    store.create_session("sess_a", "h", "", {})
    item = store.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.text = "changed"  # type: ignore[misc]


# -- durability -----------------------------------------------------------

_CRASHING_WRITER = """
import os, sys
from streamchat.store import Store
store = Store(sys.argv[1])
store.migrate()
store.create_session("sess_a", "h", "sys", {"window": 8})
store.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
store.add_item("sess_a", "item_2", "assistant", "response", "Hel", "in_progress", 1)
store.append_text("sess_a", "item_2", "lo", 1)
store.update_session("sess_a", total_tokens=3)
os._exit(0)  # die without closing anything: no checkpoint, no dispose
"""


def test_acknowledged_writes_survive_crash(url: str) -> None:
    """Writes returned by a process that then dies abruptly are read back by a new Store."""
    subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASHING_WRITER), url], check=True, timeout=60)
    with Store(url) as s:
        assert _summary(s, "sess_a") == [
            (0, "item_1", "user", "message", "hi", 1, "completed"),
            (1, "item_2", "assistant", "response", "Hello", 2, "in_progress"),
        ]
        record = s.get_session("sess_a")
        assert (record.settings, record.total_tokens, record.num_items) == ({"window": 8}, 3, 2)


def test_readable_from_another_process(store: Store, url: str) -> None:
    """A separate process opening the same file sees every committed row."""
    store.create_session("sess_a", "h", "", {})
    store.add_item("sess_a", "item_1", "user", "message", "hi", "completed", 1)
    reader = "import sys; from streamchat.store import Store; print(Store(sys.argv[1]).items('sess_a')[0].text)"
    out = subprocess.run([sys.executable, "-c", reader, url], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout == "hi\n"


# -- tokens ---------------------------------------------------------------


def test_resume_tokens() -> None:
    """Tokens are long and distinct; only the right token verifies against its hash."""
    token, other = new_resume_token(), new_resume_token()
    assert token != other and len(token) >= 32  # 24 bytes base64url = 32 chars = 192 bits
    digest = hash_token(token)
    assert len(digest) == 64 and int(digest, 16) >= 0 and token not in digest
    assert verify_token(token, digest)
    assert not verify_token(other, digest)
    assert not verify_token(token, "not-a-hash-é")


# -- model-based ----------------------------------------------------------

TEXT = st.text(max_size=12)  # any code point, NUL included
ROLES = st.sampled_from(["system", "user", "assistant"])
KINDS = st.sampled_from(["message", "append", "response"])
FIRST = st.sampled_from(["in_progress", "completed"])
FINAL = st.sampled_from(["completed", "incomplete", "cancelled", "failed"])
COUNT = st.integers(0, 9)


class Transcript(RuleBasedStateMachine):
    """Drives one fresh session and checks it against a list of dicts after every step."""

    handles = Bundle("handles")

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.session_id = f"sess_{uuid.uuid4().hex}"
        store.create_session(self.session_id, "h", "", {})
        self.model: list[dict] = []

    @rule(target=handles, role=ROLES, kind=KINDS, status=FIRST, text=TEXT, num_tokens=COUNT)
    def add(self, role: str, kind: str, status: str, text: str, num_tokens: int) -> int:
        entry = dict(item_id=f"item_{len(self.model)}", role=role, kind=kind, text=text,
                     num_tokens=num_tokens, status=status)  # fmt: skip
        record = self.store.add_item(self.session_id, **entry)
        assert record.seq == len(self.model)
        self.model.append(entry)
        return record.seq

    @rule(seq=handles, text=TEXT, added=COUNT)
    def append(self, seq: int, text: str, added: int) -> None:
        entry = self.model[seq]
        if entry["status"] != "in_progress":
            with pytest.raises(ItemNotOpen):
                self.store.append_text(self.session_id, entry["item_id"], text, added)
            return
        self.store.append_text(self.session_id, entry["item_id"], text, added)
        entry["text"] += text
        entry["num_tokens"] += added

    @rule(seq=handles, status=FINAL, text=st.none() | TEXT, num_tokens=st.none() | COUNT)
    def finish(self, seq: int, status: str, text: str | None, num_tokens: int | None) -> None:
        entry = self.model[seq]
        if entry["status"] != "in_progress":
            with pytest.raises(ItemNotOpen):
                self.store.finish_item(self.session_id, entry["item_id"], status=status)
            return
        self.store.finish_item(self.session_id, entry["item_id"], text=text, status=status, num_tokens=num_tokens)
        entry["status"] = status
        entry["text"] = entry["text"] if text is None else text
        entry["num_tokens"] = entry["num_tokens"] if num_tokens is None else num_tokens

    @invariant()
    def store_matches_model(self) -> None:
        expected = [(seq, e["item_id"], e["role"], e["kind"], e["text"], e["num_tokens"], e["status"])
                    for seq, e in enumerate(self.model)]  # fmt: skip
        assert _summary(self.store, self.session_id) == expected
        assert self.store.get_session(self.session_id).num_items == len(self.model)


def test_store_matches_pure_python_model(store: Store) -> None:
    """Random add/append/finish sequences read back exactly as a list of dicts predicts."""
    run_state_machine_as_test(
        lambda: Transcript(store),
        settings=settings(
            max_examples=30,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
