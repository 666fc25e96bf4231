"""Tests of tests/pgcluster.py: the PostgreSQL the store's tests run on, and how it fails when missing."""

from __future__ import annotations

from pathlib import Path

import pgcluster
import pytest
from sqlalchemy import create_engine


def test_missing_server_is_an_error_saying_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no initdb where the binaries are looked for, the cluster fails with what to install (the fixture fails, never skips)."""
    monkeypatch.setenv("STREAMCHAT_PG_BINDIR", str(tmp_path))
    with pytest.raises(pgcluster.ClusterError) as info:
        pgcluster.find_bindir()
    assert str(info.value) == (
        f"PostgreSQL server binaries (initdb, pg_ctl) not found in STREAMCHAT_PG_BINDIR={tmp_path}: "
        "install Debian's postgresql package (`make postgres`, as root)"
    )


def test_each_test_gets_an_empty_utf8_database(pg_url: str, pg_cluster: pgcluster.Cluster) -> None:
    """The test's database is its own, empty, UTF8 with C collation, on a socket-only server with fsync off."""
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT current_database(), pg_encoding_to_char(encoding), datcollate, current_setting('fsync'),"
            " current_setting('listen_addresses'), (SELECT count(*) FROM pg_tables WHERE schemaname = 'public')"
            " FROM pg_database WHERE datname = current_database()"
        ).one()
    engine.dispose()
    assert tuple(row)[1:] == ("UTF8", "C", "off", "", 0)
    assert row[0].startswith("test_")
    assert pg_url == f"postgresql+psycopg://postgres@/{row[0]}?host={pg_cluster.root}"
