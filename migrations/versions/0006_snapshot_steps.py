"""Steps beside the view snapshots: each job's loss by step and time marks, in chunks.

A reader of the log that counts more than the views hold (the API's loss curve and its scans
from a time, ``controlplane.core.steps``) starts from these rather than from the log's first
event: every snapshot adds, per job whose view moved, one chunk of what the events folded
since the previous snapshot counted (``snapshot_steps``, keyed by the job and the snapshot's
position). The chunks through ``snapshot_head.position`` make, in order, what counting every
event of the job through there makes. A cache like the snapshots: emptying it loses nothing.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "snapshot_steps",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("position", sa.BigInteger, primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    # The bodies are compressed already: stored out of line as they are.
    op.execute("ALTER TABLE snapshot_steps ALTER COLUMN body SET STORAGE EXTERNAL")
    # A snapshot that predates the chunks cannot be extended by them: the next leader folds
    # the log and records a whole one with its chunks.
    op.execute("DELETE FROM snapshot_head")
    op.execute("DELETE FROM view_snapshots")


def downgrade() -> None:
    op.drop_table("snapshot_steps")
