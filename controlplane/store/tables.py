"""The PostgreSQL schema as SQLAlchemy Core tables; migrations/ creates it."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

#: The append-only log (migration 0007): partitioned by list on ``expiring``, into
#: ``events_kept`` (one table, ``event_id`` unique across it) and ``events_expiring`` (step
#: records and interval liveness summaries, what retention may drop), itself partitioned by
#: range of ``position``, a span of the log each (``controlplane.store.postgres``).
#: ``position`` is gap-free and in commit order (see ``log_head``); indexed, without a
#: unique constraint (none can span both lists).
events = Table(
    "events",
    metadata,
    Column("position", BigInteger, nullable=False),
    Column("event_id", Uuid, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("type", Text, nullable=False),
    Column("v", SmallInteger, nullable=False),
    Column("source", Text, nullable=False),
    Column("incarnation", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("emitted_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("expiring", Boolean, nullable=False, server_default="false"),
    Index("events_position", "position"),
    Index("events_job_position", "job_id", "position"),
    Index("events_job_type_position", "job_id", "type", "position"),
)

#: One row: the last position handed out. Its row lock makes appends a single writer, so a
#: reader tailing by position can never pass a lower position that commits later.
log_head = Table(
    "log_head",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("position", BigInteger, nullable=False),
    CheckConstraint("id = 1", name="log_head_single_row"),
)

#: Highest seq accepted per (job, source, incarnation).
source_cursors = Table(
    "source_cursors",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("source", Text, primary_key=True),
    Column("incarnation", Text, primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
    #: Inclusive [lo, hi] ranges below last_seq that have not arrived (late arrivals fill them).
    Column("holes", JSONB, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

#: Sequence numbers a source skipped: recorded, never fatal.
seq_gaps = Table(
    "seq_gaps",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("job_id", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("incarnation", Text, nullable=False),
    Column("after_seq", BigInteger, nullable=False),
    Column("next_seq", BigInteger, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
)

#: Input that could not become an event, with the reason. Unique keys make redelivery harmless.
dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("stream_seq", BigInteger, nullable=True, unique=True),
    Column("event_id", Text, nullable=True, unique=True),
    Column("subject", Text, nullable=False),
    Column("job_id", Text, nullable=True),
    Column("raw", LargeBinary, nullable=False),
    Column("reason", Text, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False),
)

#: Every job's encoded view (``controlplane.core.snapshot``) at the position of its last event;
#: a cache of the fold that ``snapshot_head`` says is whole through one log position.
view_snapshots = Table(
    "view_snapshots",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("body", LargeBinary, nullable=False),
)

#: What each snapshot's events counted beside the views, per job whose view moved
#: (``controlplane.core.steps``: losses by step, time marks): one chunk per job per snapshot,
#: at the snapshot's position; in order, a job's chunks make what counting its events makes.
snapshot_steps = Table(
    "snapshot_steps",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("position", BigInteger, primary_key=True),
    Column("body", LargeBinary, nullable=False),
)

#: One row (or none: no snapshot yet): the log position through which ``view_snapshots`` holds
#: every event, and the fold that wrote them (``fold_version``).
snapshot_head = Table(
    "snapshot_head",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("position", BigInteger, nullable=False),
    Column("fold_version", Text, nullable=False),
    Column("taken_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("id = 1", name="snapshot_head_single_row"),
)
