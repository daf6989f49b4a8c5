"""The events table partitioned: what retention may drop apart from what is kept.

``events`` becomes a partitioned table, by list on a new column ``expiring``:

- ``events_kept`` (``expiring`` false): every event a decision, a restore, a replay or the API
  needs for as long as the log lives: decisions, faults, incidents, members' reports, backup
  catalogs, and the liveness summaries a decision read (reason ``decision``). One table, so
  its unique index on ``event_id`` is unique across the whole of it: PostgreSQL enforces a
  unique constraint across partitions only when it holds the partition key.
- ``events_expiring`` (``expiring`` true): the observations a retention policy may drop, step
  records (``train.step``) and interval liveness summaries, partitioned again by range of
  ``position`` (positions grow with commit time, so each range is a span of time, about a
  day: the store opens the next one as the log reaches it). Dropping a span is dropping a
  table (``elasticctl retention``), never a mass DELETE. Each span has its own unique index
  on ``event_id``.

Every index the table had stays, on the partitioned table (each partition gets its own),
but for the primary key: positions stay gap-free and in commit order under the
``log_head`` row lock, as before, and are indexed (``events_position``) without a unique
constraint (one cannot span the two lists). The existing rows are copied into the new
table (each classified as above), so this revision takes as long as copying the log.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_COLUMNS = (
    "position, event_id, job_id, type, v, source, incarnation, seq, generation, emitted_at,"
    " recorded_at, payload"
)
#: What retention may drop (``controlplane.store.postgres.is_expiring`` says the same).
_EXPIRING = (
    "(type = 'train.step' OR (type = 'liveness.summary' AND payload->>'reason' = 'interval'))"
)
#: Positions in the first span opened after the copied log (the store sizes the next ones
#: from the rate at which the log grew over it).
_FIRST_SPAN = 1000
_OLD_INDEXES = (
    "events_pkey",
    "events_event_id_key",
    "events_job_position",
    "events_job_type_position",
    "events_job_member_position",
)


def _span(lo: int, hi: int) -> None:
    name = f"events_expiring_{lo}"
    op.execute(f"CREATE TABLE {name} PARTITION OF events_expiring FOR VALUES FROM ({lo}) TO ({hi})")
    op.execute(f"CREATE UNIQUE INDEX {name}_event_id ON {name} (event_id)")


def upgrade() -> None:
    found = op.get_bind().execute(sa.text("SELECT position FROM log_head WHERE id = 1"))
    head = int(found.scalar() or 0)
    op.execute("ALTER TABLE events RENAME TO events_0006")
    for index in _OLD_INDEXES:
        op.execute(f"ALTER INDEX IF EXISTS {index} RENAME TO {index}_0006")
    op.execute(
        "CREATE TABLE events ("
        " position bigint NOT NULL, event_id uuid NOT NULL, job_id text NOT NULL,"
        " type text NOT NULL, v smallint NOT NULL, source text NOT NULL,"
        " incarnation text NOT NULL, seq bigint NOT NULL, generation bigint NOT NULL,"
        " emitted_at timestamptz NOT NULL, recorded_at timestamptz NOT NULL,"
        " payload jsonb NOT NULL, expiring boolean NOT NULL DEFAULT false"
        ") PARTITION BY LIST (expiring)"
    )
    # As revision 0003 set: large payloads out of line, uncompressed (inherited by every
    # partition created after).
    op.execute("ALTER TABLE events ALTER COLUMN payload SET STORAGE EXTERNAL")
    op.execute("CREATE TABLE events_kept PARTITION OF events FOR VALUES IN (false)")
    op.execute(
        "CREATE TABLE events_expiring PARTITION OF events FOR VALUES IN (true)"
        " PARTITION BY RANGE (position)"
    )
    op.execute("CREATE INDEX events_position ON events (position)")
    op.execute("CREATE INDEX events_job_position ON events (job_id, position)")
    op.execute("CREATE INDEX events_job_type_position ON events (job_id, type, position)")
    op.execute(
        "CREATE INDEX events_job_member_position ON events"
        " (job_id, split_part(source, '/', 2), position)"
    )
    op.execute("CREATE UNIQUE INDEX events_kept_event_id ON events_kept (event_id)")
    if head > 0:
        _span(1, head + 1)  # the log so far: retention drops its observations once old
    _span(head + 1, head + 1 + _FIRST_SPAN)
    op.execute(
        f"INSERT INTO events ({_COLUMNS}, expiring) SELECT {_COLUMNS}, {_EXPIRING} FROM events_0006"
    )
    op.execute("DROP TABLE events_0006")
    op.execute("ANALYZE events")


def downgrade() -> None:
    op.execute("ALTER TABLE events RENAME TO events_0007")
    for index in ("events_position", *_OLD_INDEXES[2:]):
        op.execute(f"ALTER INDEX IF EXISTS {index} RENAME TO {index}_0007")
    op.execute(
        "CREATE TABLE events ("
        " position bigint PRIMARY KEY, event_id uuid NOT NULL UNIQUE, job_id text NOT NULL,"
        " type text NOT NULL, v smallint NOT NULL, source text NOT NULL,"
        " incarnation text NOT NULL, seq bigint NOT NULL, generation bigint NOT NULL,"
        " emitted_at timestamptz NOT NULL, recorded_at timestamptz NOT NULL,"
        " payload jsonb NOT NULL)"
    )
    op.execute("ALTER TABLE events ALTER COLUMN payload SET STORAGE EXTERNAL")
    op.execute("CREATE INDEX events_job_position ON events (job_id, position)")
    op.execute("CREATE INDEX events_job_type_position ON events (job_id, type, position)")
    op.execute(
        "CREATE INDEX events_job_member_position ON events"
        " (job_id, split_part(source, '/', 2), position)"
    )
    # A reused event_id stored in two partitions (possible only for observations: see
    # upgrade) is kept once, at its first position.
    op.execute(
        f"INSERT INTO events ({_COLUMNS}) SELECT DISTINCT ON (event_id) {_COLUMNS}"
        " FROM events_0007 ORDER BY event_id, position"
    )
    op.execute("DROP TABLE events_0007")
