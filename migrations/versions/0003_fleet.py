"""A fleet of daemons: session leases and the daemon registry.

Revision ID: 0003
Revises: 0002
Create Date: 2026-05-20 00:00:01

Hand-written to match `streamchat.store.models.LeaseRow` and `DaemonRow`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID_LENGTH = 128
STATUS_LENGTH = 16


def upgrade() -> None:
    op.create_table(
        "session_leases",
        sa.Column("session_id", sa.String(ID_LENGTH), nullable=False),
        sa.Column("owner", sa.String(ID_LENGTH), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_session_leases_session_id_sessions", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_id", name="pk_session_leases"),
    )
    op.create_index("ix_session_leases_owner", "session_leases", ["owner"])
    op.create_table(
        "daemons",
        sa.Column("id", sa.String(ID_LENGTH), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(STATUS_LENGTH), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_daemons"),
    )


def downgrade() -> None:
    op.drop_table("daemons")
    op.drop_index("ix_session_leases_owner", table_name="session_leases")
    op.drop_table("session_leases")
