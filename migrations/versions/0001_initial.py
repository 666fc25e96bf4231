"""Initial schema: sessions and their transcript items.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00

Hand-written to match `streamchat.store.models` exactly; the store's tests
run `alembic check` against a migrated database to prove it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID_LENGTH = 128
STATUS_LENGTH = 16


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(ID_LENGTH), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("total_tokens", sa.Integer(), nullable=False),
        sa.Column("evicted_tokens", sa.Integer(), nullable=False),
        sa.Column("num_items", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_active_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(STATUS_LENGTH), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_last_active_at", "sessions", ["last_active_at"])
    op.create_table(
        "items",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(ID_LENGTH), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.String(ID_LENGTH), nullable=False),
        sa.Column("role", sa.String(STATUS_LENGTH), nullable=False),
        sa.Column("kind", sa.String(STATUS_LENGTH), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(STATUS_LENGTH), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_items_session_id_sessions", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_items"),
        sa.UniqueConstraint("session_id", "seq", name="uq_items_session_id_seq"),
        sa.UniqueConstraint("session_id", "item_id", name="uq_items_session_id_item_id"),
    )
    op.create_index("ix_items_session_id", "items", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_items_session_id", table_name="items")
    op.drop_table("items")
    op.drop_index("ix_sessions_last_active_at", table_name="sessions")
    op.drop_table("sessions")
