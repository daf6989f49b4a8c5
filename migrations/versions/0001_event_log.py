"""The event log, its single-writer head, sequence cursors and gaps, and dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.Uuid, nullable=False, unique=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("v", sa.SmallInteger, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("incarnation", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("emitted_at", _TS, nullable=False),
        sa.Column("recorded_at", _TS, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
    )
    op.create_index("events_job_position", "events", ["job_id", "position"])
    op.create_index("events_job_type_position", "events", ["job_id", "type", "position"])

    op.create_table(
        "log_head",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.CheckConstraint("id = 1", name="log_head_single_row"),
    )
    op.execute("INSERT INTO log_head (id, position) VALUES (1, 0)")

    op.create_table(
        "source_cursors",
        sa.Column("job_id", sa.Text, primary_key=True),
        sa.Column("source", sa.Text, primary_key=True),
        sa.Column("incarnation", sa.Text, primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("holes", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("updated_at", _TS, nullable=False),
    )
    op.create_table(
        "seq_gaps",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("incarnation", sa.Text, nullable=False),
        sa.Column("after_seq", sa.BigInteger, nullable=False),
        sa.Column("next_seq", sa.BigInteger, nullable=False),
        sa.Column("recorded_at", _TS, nullable=False),
    )
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("stream_seq", sa.BigInteger, nullable=True, unique=True),
        sa.Column("event_id", sa.Text, nullable=True, unique=True),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text, nullable=True),
        sa.Column("raw", sa.LargeBinary, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("received_at", _TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("dead_letters", "seq_gaps", "source_cursors", "log_head", "events"):
        op.drop_table(table)
