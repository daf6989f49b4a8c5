"""An index for the REST API's member filter.

``GET /jobs/{job}/events?member=M`` reads ``(job_id, split_part(source, '/', 2), position)``
in position order, so a page costs its own rows even for a member with few events. (The time
filter needs no index: the API knows, from the views it folds, where a time starts in a job.)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "events_job_member_position",
        "events",
        ["job_id", sa.text("split_part(source, '/', 2)"), "position"],
    )


def downgrade() -> None:
    op.drop_index("events_job_member_position", table_name="events")
