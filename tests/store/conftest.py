"""The database URL the store's tests run against: every test taking `url` runs on SQLite and on PostgreSQL."""

from pathlib import Path

import pytest
from clocks import ManualClock


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file of its own, for what only SQLite has (pragmas, file URIs, injected driver faults)."""
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    """A fresh database of the test's own: a SQLite file, then a database in the test PostgreSQL cluster."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def clock() -> ManualClock:
    """One hand-moved clock for every store a test opens (one fleet, one time)."""
    return ManualClock()
