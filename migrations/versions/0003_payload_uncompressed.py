"""Large payloads stored out of line without compression.

A decision at 4,096 ranks records about 170 KB of JSON in one append (the world, the restore
plan, the placement), and PostgreSQL compressed each large payload with pglz inside the
decider's transaction, on the path from a fault to the command: a quarter of that append's
time (21 -> 17 ms on a quiet 2-core machine; lz4 is not in every server build). Payloads under
about 2 KB (nearly every event) are stored inline as before; only the rare large ones take
more disk. Rows written before this revision keep their compression.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE events ALTER COLUMN payload SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE events ALTER COLUMN payload SET STORAGE EXTENDED")
