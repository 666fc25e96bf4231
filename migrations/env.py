"""Alembic environment of the store: run by `streamchat.store.migrate`, never by hand-edited ini.

A caller may pass an open connection in `config.attributes["connection"]`
(the store does, so its SQLite pragmas apply); otherwise an engine is made
from `sqlalchemy.url` with the same pragmas.
"""

from __future__ import annotations

import logging

from alembic import context
from sqlalchemy.engine import Connection

from streamchat.store.database import make_engine
from streamchat.store.models import Base

logger = logging.getLogger(__name__)
config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    """Emit the SQL for the pending migrations without a database (alembic --sql)."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the pending migrations on the given connection, or on a fresh engine."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as fresh:  # one transaction for all pending migrations
            _run(fresh)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
