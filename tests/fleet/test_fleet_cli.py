"""Tests of `streamchat fleet` and streamchat.store.report: the registry as a table and as JSON."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from streamchat.cli import main
from streamchat.store import DaemonState, Store
from streamchat.store.report import fleet_table

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def test_table_rows_ages_and_summary() -> None:
    """Columns align, ages are short, long session lists are cut to three, and a summary line ends the table."""
    states = [
        DaemonState("d1", "10.0.0.1:8765", "live", _at(0), _at(95), ("s1", "s2", "s3", "s4", "s5")),
        DaemonState("daemon-two", "10.0.0.2:8765", "stale", _at(0), _at(-7200), ()),
        DaemonState("ghost", None, "unregistered", None, None, ("s9",)),
    ]
    assert fleet_table(states, now=_at(99.25)).splitlines() == [
        "DAEMON      STATE         ADDRESS        HEARTBEAT  STARTED               SESSIONS",
        "d1          live          10.0.0.1:8765  4.2s ago   2025-01-01 00:00:00Z  5  s1, s2, s3, +2 more",
        "daemon-two  stale         10.0.0.2:8765  2h ago     2025-01-01 00:00:00Z  0",
        "ghost       unregistered  -              -          -                     1  s9",
        "3 daemons (1 live, 1 stale, 1 unregistered); 6 sessions leased",
    ]


def test_fleet_json_from_a_postgresql_store(pg_url: str, capsys: pytest.CaptureFixture) -> None:
    """--json lists every daemon with its state and leased sessions, as the registry holds them."""
    with Store(pg_url, clock=lambda: T0) as old:
        old.migrate()
        old.create_session("sess_a", "h", "", {})
        old.daemons.register("d-old", "10.0.0.9:8765")
    with Store(pg_url) as now:
        now.daemons.register("d-new", "10.0.0.1:8765")
        now.leases.acquire("sess_a", "d-new", 60)
    assert main(["fleet", "--database-url", pg_url, "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)
    assert [(d["id"], d["state"], d["address"], d["sessions"]) for d in fleet] == [
        ("d-new", "live", "10.0.0.1:8765", ["sess_a"]),
        ("d-old", "stale", "10.0.0.9:8765", []),
    ]
    assert fleet[1]["heartbeat_at"] == fleet[1]["started_at"] == "2025-01-01T00:00:00+00:00"


def test_table_is_the_default(pg_url: str, capsys: pytest.CaptureFixture) -> None:
    """Without --json the same registry prints as the table; --lease-s sets when a silent daemon is stale."""
    with Store(pg_url, clock=lambda: dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=30)) as s:
        s.migrate()
        s.daemons.register("d1", "a:1")
    assert main(["fleet", "--database-url", pg_url, "--lease-s", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["DAEMON", "STATE", "ADDRESS", "HEARTBEAT", "STARTED", "SESSIONS"]
    assert out[1].split()[:3] == ["d1", "live", "a:1"] and out[-1] == "1 daemons (1 live); 0 sessions leased"
    assert main(["fleet", "--database-url", pg_url, "--lease-s", "20"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["d1", "stale"]


def test_missing_or_old_store_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A SQLite file that is not there is not created; a store behind this version says to migrate it."""
    missing = tmp_path / "none.db"
    assert main(["fleet", "--database-url", f"sqlite:///{missing}"]) == 2
    assert capsys.readouterr().err == f"streamchat: error: no store at sqlite:///{missing} (give the fleet's --database-url)\n"
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    Store(f"sqlite:///{empty}").close()
    empty.touch()
    assert main(["fleet", "--database-url", f"sqlite:///{empty}"]) == 2
    assert capsys.readouterr().err == (
        f"streamchat: error: the store at sqlite:///{empty} is at revision none, not 0003: "
        "start a daemon of this version on it to migrate it\n"
    )


def test_server_down_is_store_unavailable(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A PostgreSQL URL whose server is not there exits 1 with store_unavailable's words, no traceback."""
    assert main(["fleet", "--database-url", f"postgresql+psycopg://postgres@/x?host={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("streamchat: error: the store is unavailable: ") and "Traceback" not in err
