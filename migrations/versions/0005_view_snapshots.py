"""View snapshots: every job's view folded through one log position.

A leader (a restart, a standby taking over) starts from the newest snapshot and folds only
the log after its position (``controlplane.core.snapshot``): start-up costs the tail, not the
log's age. ``view_snapshots`` holds one row per job (its view's last position and its
encoded view); ``snapshot_head`` says through which log position the rows hold every event,
and which fold wrote them. Both are a cache: emptying them loses nothing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "view_snapshots",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    # The bodies are compressed already: stored out of line as they are.
    op.execute("ALTER TABLE view_snapshots ALTER COLUMN body SET STORAGE EXTERNAL")
    op.create_table(
        "snapshot_head",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("fold_version", sa.Text, nullable=False),
        sa.Column("taken_at", _TS, nullable=False),
        sa.CheckConstraint("id = 1", name="snapshot_head_single_row"),
    )


def downgrade() -> None:
    op.drop_table("snapshot_head")
    op.drop_table("view_snapshots")
