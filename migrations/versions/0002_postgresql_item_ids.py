"""PostgreSQL: items.item_id becomes TEXT.

Revision ID: 0002
Revises: 0001
Create Date: 2026-05-20 00:00:00

Clients choose item ids, as long as the protocol allows (more than 128
characters). SQLite never enforced VARCHAR(128), so there nothing changes
(`models.ITEM_ID_TYPE` keeps VARCHAR(128) for SQLite); PostgreSQL enforces
it, and would refuse such an id with an error no client could act on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID_LENGTH = 128


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("items", "item_id", type_=sa.Text(), existing_type=sa.String(ID_LENGTH),
                        existing_nullable=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Fails, changing nothing, if an id longer than 128 characters was stored since.
        op.alter_column("items", "item_id", type_=sa.String(ID_LENGTH), existing_type=sa.Text(),
                        existing_nullable=False)
