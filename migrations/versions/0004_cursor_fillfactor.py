"""Room on each page of the source cursors for their updates.

Every accepted event moves its source's cursor: at a backup of a 4,096-rank job, 4,096 rows
updated at once, every ten seconds. With full pages an update writes its new version on
another page, with a new primary-key entry, so the table and its index grow between two
vacuums by a row per update, for a table whose live size is a row per source. With half of
each page free, an update that changes no key column (none does: the key is the source) can
stay on its page as a heap-only tuple, without an index entry, and the page's older versions
are pruned when it is next read. Existing pages are left as they are until they are
rewritten (``VACUUM FULL``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE source_cursors SET (fillfactor = 50)")
    op.execute("ALTER TABLE log_head SET (fillfactor = 50)")


def downgrade() -> None:
    op.execute("ALTER TABLE source_cursors RESET (fillfactor)")
    op.execute("ALTER TABLE log_head RESET (fillfactor)")
