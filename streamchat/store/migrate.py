"""Alembic, driven from code: the only way the store's schema is created.

The scripts live in the `streamchat.migrations` package (the `migrations/`
folder of the source tree); no alembic.ini is read. The same `Config` serves
`upgrade` at start-up and `check` in the tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

# Alembic keeps the running migration's context in module globals (env.py reads `alembic.context`), so
# two stores of one process migrating at once would run each other's scripts: one migration at a time.
_alembic_lock = threading.RLock()


@contextlib.contextmanager
def _quiet_alembic():
    """One alembic call at a time in this process, without alembic's INFO lines (plugins set up, the
    SQLite impl, each revision run): they say nothing an operator acts on; its warnings still show."""
    alembic_log = logging.getLogger("alembic")
    with _alembic_lock:
        level = alembic_log.level
        alembic_log.setLevel(max(logging.WARNING, level))
        try:
            yield
        finally:
            alembic_log.setLevel(level)


with _quiet_alembic():  # importing alembic logs a line per plugin it sets up
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

from sqlalchemy import Engine, text
from sqlalchemy.engine import URL, make_url

import streamchat.migrations

logger = logging.getLogger(__name__)


def script_location() -> str:
    """The folder holding env.py and versions/ of the installed package."""
    return os.path.dirname(os.path.abspath(streamchat.migrations.__file__))


def alembic_config(url: str | URL) -> Config:
    """An alembic Config for `url`, built without any ini file."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    rendered = make_url(url).render_as_string(hide_password=False)
    # The config is a ConfigParser: a literal % (URL-escaped passwords) must be doubled.
    cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


# pg_advisory_xact_lock key serialising migrations of one PostgreSQL database
# (the bytes of "streamchat" folded into a bigint; any constant would do).
MIGRATION_LOCK_KEY = int.from_bytes(b"streamch", "big") >> 1


def upgrade_to_head(engine: Engine) -> None:
    """Run every pending migration on `engine` in one transaction.

    On PostgreSQL the transaction first takes an advisory lock, so daemons of a
    fleet started together migrate one after another: the first migrates,
    the others then find the schema at head. (SQLite's write lock does the same.)
    """
    cfg = alembic_config(engine.url)
    with _quiet_alembic(), engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        # env.py uses this connection, so the engine's pragmas apply to the DDL.
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
        revision = MigrationContext.configure(connection).get_current_revision()
    logger.debug("store schema at revision %s", revision)


def check_writable(engine: Engine) -> None:
    """Raise the driver's error unless the database takes a write; changes nothing.

    A migration already at head writes nothing, so without this a read-only
    file (SQLite `mode=ro`, a read-only mount) would only fail at the first write.
    """
    with engine.connect() as connection:
        # Rewrites the version row with its own value; any write needs the write lock.
        connection.execute(text("UPDATE alembic_version SET version_num = version_num"))
        connection.rollback()


def current_revision(engine: Engine) -> str | None:
    """The revision recorded in the database, None before the first migration."""
    with _quiet_alembic(), engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    """The newest revision this version of the package ships."""
    script = ScriptDirectory(script_location())
    head = script.get_current_head()
    assert head is not None, "the package ships no migrations"
    return head
