"""The PostgreSQL event store: batched, idempotent, gap-free appends with COPY.

One append is one transaction: lock the ``log_head`` row (the single-writer rule that keeps
positions gap-free and in commit order), drop event_ids already stored, apply the sequence
rules, COPY the new rows, move the cursors and the head, record dead letters, commit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from pydantic_core import to_json
from sqlalchemy import Engine, create_engine
from sqlalchemy.dialects.postgresql import insert as pg_insert

from controlplane.core.catalog import CATALOG, PACKED, pack, unpacked
from controlplane.core.records import DeadLetter, StoredEvent
from controlplane.core.sequence import Cursor, CursorKey, SeqGap, sequence
from controlplane.core.view import MAX_STEP_LEAD
from controlplane.decode import storable
from controlplane.errors import (
    ConcurrencyError,
    SchemaNotMigrated,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from controlplane.settings import libpq_url, sqlalchemy_url
from controlplane.store.planning import gap_rows, refused_letters, split_stale, unique
from controlplane.store.port import AppendResult, JobHead, StoredDeadLetter, ViewSnapshot, paged
from controlplane.store.tables import dead_letters as dead_letters_table
from controlplane.store.tables import events as events_table
from controlplane.store.tables import seq_gaps as seq_gaps_table
from controlplane.store.tables import snapshot_head, snapshot_steps, view_snapshots
from schemas.events import EVENT_ADAPTER, BackupCatalog, EnvelopeBase, PackedCatalog

#: The head row's ``xmin`` names the last transaction that wrote to the log or the cursors
#: (every one moves the head, see ``_append_steps``): a ``CursorCache``'s check.
_LOCK_HEAD = "SELECT position, clock_timestamp(), xmin::text FROM log_head WHERE id = 1 FOR UPDATE"
#: The job's newest position at or after the one the writer expects (0: none): the same
#: test as the job's newest position, but pruned to the spans from there on, however many
#: spans the log has.
_JOB_HEAD = "SELECT coalesce(max(position), 0) FROM events WHERE job_id = %s AND position >= %s"
_COPY_EVENTS = (
    "COPY events (position, recorded_at, expiring, event_id, job_id, type, v, source,"
    " incarnation, seq, generation, emitted_at, payload) FROM STDIN"
)
_KNOWN_IDS = "SELECT event_id::text FROM events WHERE event_id = ANY(%s::uuid[])"
#: Ids of observations stored from position ``%s`` on (the span before the current one and
#: this one): each span's own unique index sees only its own rows.
_KNOWN_EXPIRING = (
    "SELECT event_id::text FROM events_expiring WHERE event_id = ANY(%s::uuid[]) AND position >= %s"
)
#: The spans of ``events_expiring``: each partition's name and bounds.
_SPANS = (
    "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
    " JOIN pg_class c ON c.oid = i.inhrelid"
    " WHERE i.inhparent = 'events_expiring'::regclass AND NOT i.inhdetachpending"
)
_FIRST_AT = "SELECT recorded_at FROM events WHERE position >= %s ORDER BY position LIMIT 1"
_MOVE_HEAD = "UPDATE log_head SET position = %s WHERE id = 1 RETURNING xmin::text"
_SELECT_CURSORS = (
    "SELECT c.job_id, c.source, c.incarnation, c.last_seq, c.holes FROM source_cursors c"
    " JOIN unnest(%s::text[], %s::text[], %s::text[]) AS k(job_id, source, incarnation)"
    " USING (job_id, source, incarnation)"
)
_UPSERT_CURSORS = (
    "INSERT INTO source_cursors (job_id, source, incarnation, last_seq, holes, updated_at)"
    " SELECT j, s, i, q, h::jsonb, %s"
    " FROM unnest(%s::text[], %s::text[], %s::text[], %s::int8[], %s::text[]) AS k(j, s, i, q, h)"
    " ON CONFLICT (job_id, source, incarnation) DO UPDATE SET last_seq = EXCLUDED.last_seq,"
    " holes = EXCLUDED.holes, updated_at = EXCLUDED.updated_at"
)
#: Every dead letter of an append in one statement (one per letter made a batch of fuzzed
#: input, two thirds dead letters, take twice as long; ``elasticctl bench fuzz``).
_INSERT_DEAD = (
    "INSERT INTO dead_letters (stream_seq, event_id, subject, job_id, raw, reason, received_at)"
    " SELECT q, e, s, j, r, why, %s FROM unnest(%s::int8[], %s::text[], %s::text[], %s::text[],"
    " %s::bytea[], %s::text[]) AS d(q, e, s, j, r, why) ON CONFLICT DO NOTHING"
)
_INSERT_GAP = (
    "INSERT INTO seq_gaps (job_id, source, incarnation, after_seq, next_seq, recorded_at)"
    " SELECT j, s, i, a, n, %s FROM unnest(%s::text[], %s::text[], %s::text[], %s::int8[],"
    " %s::int8[]) AS g(j, s, i, a, n)"
)


@contextmanager
def raw_connection(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    """A psycopg connection from ``engine``'s pool, driver errors translated: rolled back
    (or dropped when that fails) on an error, back to the pool after."""
    with translated():
        pooled = engine.raw_connection()
        conn = pooled.driver_connection
        try:
            assert isinstance(conn, psycopg.Connection)
            yield conn
        except BaseException:
            try:
                if (
                    not isinstance(conn, psycopg.Connection)
                    or conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF
                ):
                    # A statement failed inside a pipeline: libpq may still hold its results
                    # ("cannot exit pipeline mode while busy"); the connection is not reused.
                    raise StoreError("left in pipeline mode")
                pooled.rollback()
            except Exception:
                pooled.invalidate()
            raise
        finally:
            pooled.close()


#: SQLSTATE classes of a server that is unreachable, going away, short of resources or in a
#: transient conflict: the same statements may succeed later, so they are waited for.
#: 08 connection exception, 25 invalid transaction state, 40 transaction rollback
#: (serialization, deadlock), 53 insufficient resources, 55 object not in prerequisite state
#: (lock not available), 57 operator intervention (57P01-03 shutdown, 57014 cancelled),
#: 58 system error (I/O).
TRANSIENT_CLASSES = frozenset({"08", "25", "40", "53", "55", "57", "58"})


def classify(exc: psycopg.Error) -> StoreError:
    """The project's error for a driver error: by its SQLSTATE when the server sent one.

    Any other class (22 data exception, 23 integrity, 54 program limit, 42 and the rest) is
    the input's fault: ``StoreRefused``, isolated and dead-lettered by the ingest. Without a
    SQLSTATE the error is the client's: a lost or unusable connection (``OperationalError``,
    ``InterfaceError``: unavailable; "cannot exit pipeline mode while busy" is one), else
    something about the statement or its values (``DataError``, ...: refused).
    """
    message = str(exc).strip()
    state = exc.sqlstate
    if state is None:
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return StoreUnavailable(message)
        return StoreRefused(message)
    if state == "42P01":  # undefined_table
        return SchemaNotMigrated(f"{message}: run `elasticctl migrate` first")
    if state[:2] in TRANSIENT_CLASSES:
        return StoreUnavailable(message)
    return StoreRefused(message)


@contextmanager
def translated() -> Iterator[None]:
    """Turn driver errors into the project's own (the core never sees a driver type)."""
    try:
        yield
    except psycopg.Error as exc:
        raise classify(exc) from exc
    except sa.exc.DBAPIError as exc:
        if exc.connection_invalidated:
            raise StoreUnavailable(str(exc.orig).strip()) from exc
        if isinstance(exc.orig, psycopg.Error):
            raise classify(exc.orig) from exc
        raise StoreError(str(exc)) from exc


def make_engine(database_url: str, *, pool_size: int = 4) -> Engine:
    """A SQLAlchemy engine on psycopg 3 that recovers from server restarts."""
    return create_engine(
        sqlalchemy_url(database_url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_recycle=3600,
    )


class PostgresEventStore:
    """The system of record. Construction does no I/O; the engine connects on first use.
    ``spans``: how wide the partitions of observations it opens are (``SpanPolicy``)."""

    def __init__(self, engine: Engine, *, spans: SpanPolicy | None = None) -> None:
        self.engine = engine
        self.span_policy = spans or SpanPolicy()
        self._spans = SpanCache(self.span_policy)

    @classmethod
    def from_url(cls, database_url: str, *, spans: SpanPolicy | None = None) -> PostgresEventStore:
        """A store over a new engine for ``database_url``."""
        return cls(make_engine(database_url), spans=spans)

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def _raw(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        return raw_connection(self.engine)

    # ------------------------------------------------------------------ append

    def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        if not events and not dead_letters:
            return AppendResult()
        steps = _append_steps(events, dead_letters, expected, encoded, spans=self._spans)
        return self._run(steps)

    def _run(self, steps: _Steps) -> AppendResult:
        try:
            with self._raw() as conn:
                result = _run_sync(conn, steps)
                conn.commit()  # committed by the last step already; nothing left to send
        except BaseException:
            self._spans.spans = None  # a span opened in the failed transaction is not
            raise
        return result

    def import_events(self, events: Sequence[StoredEvent]) -> AppendResult:
        """See ``EventStore.import_events``."""
        if not events:
            return AppendResult()
        events = list(unpacked(events))
        recorded_at: dict[str, datetime] = {}
        for stored in events:
            recorded_at.setdefault(stored.event.event_id, stored.recorded_at)
        steps = _append_steps(
            [s.event for s in events], (), None, None, recorded_at=recorded_at, spans=self._spans
        )
        return self._run(steps)

    def appender(self) -> AsyncAppender:
        """An asyncio appender over its own connection to the same database."""
        return AsyncAppender(
            self.engine.url.render_as_string(hide_password=False), spans=self.span_policy
        )

    # ------------------------------------------------------------------ reads

    def read(
        self,
        *,
        job_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        t = events_table
        query = sa.select(t).where(t.c.position > after).order_by(t.c.position)
        if job_id is not None:
            query = query.where(t.c.job_id == job_id)
        if types:
            query = query.where(t.c.type.in_(list(types)))
        if limit is not None:
            query = query.limit(limit)
        with translated(), self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [_to_stored(row._mapping) for row in rows]

    def iter_events(
        self, *, job_id: str | None = None, after: int = 0, batch: int = 10_000
    ) -> Iterator[StoredEvent]:
        return paged(self.read, job_id=job_id, after=after, batch=batch)

    def last_position(self) -> int:
        with translated(), self.engine.connect() as conn:
            value = conn.execute(sa.text("SELECT position FROM log_head WHERE id = 1")).scalar()
        if value is None:
            raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
        return int(value)

    def dead_letters(self, *, after_id: int = 0, limit: int = 1000) -> list[StoredDeadLetter]:
        t = dead_letters_table
        query = sa.select(t).where(t.c.id > after_id).order_by(t.c.id).limit(limit)
        with translated(), self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            StoredDeadLetter(
                id=r.id,
                letter=DeadLetter(
                    reason=r.reason,
                    raw=bytes(r.raw),
                    subject=r.subject,
                    stream_seq=r.stream_seq,
                    job_id=r.job_id,
                    event_id=r.event_id,
                ),
                received_at=r.received_at,
            )
            for r in rows
        ]

    def count_dead_letters(self) -> int:
        with translated(), self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(dead_letters_table)
                ).scalar_one()
            )

    def seq_gaps(self) -> list[SeqGap]:
        t = seq_gaps_table
        with translated(), self.engine.connect() as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.id)).all()
        return [SeqGap(r.job_id, r.source, r.incarnation, r.after_seq, r.next_seq) for r in rows]

    def storage(self) -> Storage:
        """What the log takes on disk, each partition, and each job's part of it, by event
        type. A full scan of the events (an operator's command, not a service's query)."""
        by_type = sa.text(
            "SELECT job_id, type, expiring, count(*), sum(pg_column_size(e.*))::bigint,"
            " min(recorded_at), max(recorded_at) FROM events e GROUP BY job_id, type, expiring"
        )
        with translated(), self.engine.connect() as conn:
            rows = conn.execute(by_type).all()
            parts = _partition_sizes(conn)
            letters = conn.execute(
                sa.text("SELECT pg_total_relation_size('dead_letters')")
            ).scalar_one()
        jobs: dict[str, JobStorage] = {}
        for job, type_, expiring, count, row_bytes, first, last in rows:
            entry = jobs.get(job)
            if entry is None:
                entry = jobs[job] = JobStorage(job, 0, 0, first, last, {})
            entry.events += int(count)
            entry.row_bytes += int(row_bytes)
            if expiring:
                entry.expiring_bytes += int(row_bytes)
            entry.first_at, entry.last_at = min(entry.first_at, first), max(entry.last_at, last)
            n, b = entry.by_type.get(type_, (0, 0))
            entry.by_type[type_] = (n + int(count), b + int(row_bytes))
        return Storage(
            sum(p.total_bytes for p in parts),
            sum(p.table_bytes for p in parts),
            sum(p.index_bytes for p in parts),
            int(letters),
            list(jobs.values()),
            parts,
        )

    # ------------------------------------------------------------------ retention

    def spans(self) -> list[Span]:
        """The spans of observations (``events_expiring``'s partitions), oldest first, each
        with its rows and newest recording time (a scan of each: an operator's command)."""
        with translated(), self.engine.connect() as conn:
            return [
                _span_of(conn, lo, hi, name)
                for lo, hi, name in _parse_spans(conn.exec_driver_sql(_SPANS).all())
            ]

    def open_spans(self) -> list[tuple[int, int]]:
        """Open the next span of observations once the log is past the middle of the last
        one (so that an append seldom has to), under the ``log_head`` row lock; return the
        spans opened."""
        cache = SpanCache(self.span_policy)
        known: list[tuple[int, int]] = []

        def steps() -> _Steps:
            results = yield _Batch((_Query(_LOCK_HEAD, fetch="one"),))
            head, now, _ = results[0]
            yield from _ensure_spans(head, head, now, cache)
            known.extend(cache.spans or [])
            if known:
                lo, hi = known[-1]
                if head >= lo + (hi - lo) // 2:  # past its middle: the next one now
                    yield from _ensure_spans(head, hi, now, cache)
            yield _Batch((), commit=True)
            return AppendResult()

        self._run(steps())
        return [span for span in cache.spans or [] if span not in known]

    def retain(self, older_than: datetime, *, dry_run: bool = False) -> Retention:
        """Drop the spans of observations whose every row was recorded before
        ``older_than``, and that the log has moved past: each is detached (concurrently:
        readers and appends go on) and dropped, a table at a time, never a mass DELETE.
        Before a span goes, what the kept log still needs of it moves to ``events_kept``
        (``_PINS``: each process's first and last step record of each generation it ran, so
        every incident keeps the first step that resolved it; a step record every
        ``PIN_STEPS`` steps; each job's last interval summary; whatever a ``fault.detected``
        cites). ``dry_run``: say what would go, change nothing. A retention interrupted
        before (a span detached and not dropped) is finished first."""
        dropped: list[Span] = []
        pinned = 0
        with translated():
            if not dry_run:
                _finish_interrupted(self.engine)
            head = self.last_position()
            with self.engine.connect() as conn:
                spans = [
                    _span_of(conn, lo, hi, name)
                    for lo, hi, name in _parse_spans(conn.exec_driver_sql(_SPANS).all())
                ]
            due = [
                span
                for span in spans
                if span.hi - 1 <= head and (span.newest_at is None or span.newest_at < older_than)
            ]
            for span in due:
                with self.engine.begin() as conn:
                    action = _PIN_COUNT if dry_run else _PIN_UPDATE
                    statement = _PINS.format(
                        leaf=_quoted(span.name), lo=span.lo, hi=span.hi, every=PIN_STEPS,
                        action=action.format(lo=span.lo, hi=span.hi),
                    )  # fmt: skip
                    pinned += int(conn.exec_driver_sql(statement).scalar() or 0)
                if not dry_run:
                    _drop_span(self.engine, span.name)
                dropped.append(span)
        left = [s for s in spans if s not in dropped]
        return Retention(older_than, dropped, pinned, left, dry_run)

    # ------------------------------------------------------------------ view snapshots

    def save_snapshot(
        self,
        position: int,
        fold_version: str,
        bodies: Mapping[str, tuple[int, bytes]],
        *,
        taken_at: datetime,
        whole: bool,
        steps: Mapping[str, bytes] | None = None,
    ) -> bool:
        """See ``ViewSnapshots.save_snapshot``: one transaction, writers one at a time."""
        head = snapshot_head.c
        with translated(), self.engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE snapshot_head IN SHARE ROW EXCLUSIVE MODE"))
            row = conn.execute(
                sa.select(head.position, head.fold_version).where(head.id == 1)
            ).one_or_none()
            if row is not None and row.position > position:
                return False
            if not whole and (row is None or row.fold_version != fold_version):
                raise ValueError("a partial snapshot needs a whole one of the same fold before it")
            if whole:
                conn.execute(view_snapshots.delete())
                conn.execute(snapshot_steps.delete())
            if steps:
                conn.execute(
                    snapshot_steps.insert(),
                    [{"job_id": j, "position": position, "body": b} for j, b in steps.items()],
                )
            if bodies:
                rows = [
                    {"job_id": job, "position": at, "body": body}
                    for job, (at, body) in bodies.items()
                ]
                insert = pg_insert(view_snapshots)
                conn.execute(
                    insert.on_conflict_do_update(
                        index_elements=[view_snapshots.c.job_id],
                        set_={"position": insert.excluded.position, "body": insert.excluded.body},
                    ),
                    rows,
                )
            values = {"position": position, "fold_version": fold_version, "taken_at": taken_at}
            insert = pg_insert(snapshot_head).values(id=1, **values)
            conn.execute(insert.on_conflict_do_update(index_elements=[head.id], set_=values))
        return True

    def load_snapshot(self, *, steps: bool = False) -> ViewSnapshot | None:
        # One statement, so one snapshot of the database: the head and the rows it vouches for.
        query = sa.text(
            "SELECT h.position, h.fold_version, h.taken_at, s.job_id, s.body"
            " FROM snapshot_head h LEFT JOIN view_snapshots s ON true WHERE h.id = 1"
        )
        chunks: dict[str, list[bytes]] = {}
        with translated(), self.engine.connect() as conn:
            if steps:  # the chunks the head vouches for: both read in one snapshot
                conn.execution_options(isolation_level="REPEATABLE READ")
            rows = conn.execute(query).all()
            if rows and steps:
                c = snapshot_steps.c
                for job, body in conn.execute(
                    sa.select(c.job_id, c.body)
                    .where(c.position <= rows[0][0])
                    .order_by(c.job_id, c.position)
                ):
                    chunks.setdefault(job, []).append(bytes(body))
        if not rows:
            return None
        position, fold_version, taken_at = rows[0][:3]
        bodies = {job: bytes(body) for *_, job, body in rows if job is not None}
        return ViewSnapshot(int(position), fold_version, taken_at, bodies, chunks)

    def job_ids(self) -> list[str]:
        t = events_table
        first = sa.func.min(t.c.position)
        query = sa.select(t.c.job_id).group_by(t.c.job_id).order_by(first)
        with translated(), self.engine.connect() as conn:
            return [r[0] for r in conn.execute(query).all()]


@dataclass(slots=True)
class JobStorage:
    """One job's part of the log (``PostgresEventStore.storage``)."""

    job_id: str
    events: int
    #: The job's rows as PostgreSQL stores them (``pg_column_size`` of each row, its
    #: out-of-line payload included; no indexes).
    row_bytes: int
    first_at: datetime
    last_at: datetime
    #: Event type -> (events, row bytes).
    by_type: dict[str, tuple[int, int]]
    #: Of ``row_bytes``, the observations a retention may drop (``events_expiring``).
    expiring_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PartitionSize:
    """One partition of the log on disk: ``events_kept``, or a span of ``events_expiring``
    (``lo``/``hi``: its positions, ``[lo, hi)``)."""

    name: str
    expiring: bool
    lo: int | None
    hi: int | None
    #: The planner's estimate of its rows (``reltuples``; -1: never counted).
    rows: int
    total_bytes: int
    table_bytes: int
    index_bytes: int


@dataclass(frozen=True, slots=True)
class Storage:
    """The log's size on disk: the events table with its indexes and TOAST (every partition
    together, and each), and each job."""

    events_total_bytes: int
    events_table_bytes: int
    events_index_bytes: int
    dead_letters_bytes: int
    jobs: list[JobStorage]
    partitions: list[PartitionSize] = field(default_factory=list)

    def share_bytes(self, job: JobStorage) -> int:
        """The job's share of the events table with its indexes, in proportion to its rows
        (every row has the same index entries, give or take its key's length)."""
        rows = sum(j.row_bytes for j in self.jobs)
        return round(self.events_total_bytes * job.row_bytes / rows) if rows else 0


#: Every partition of the log (the leaves of ``events``) and its size.
_PARTITION_SIZES = """
SELECT c.relname, p.relname = 'events_expiring', pg_get_expr(c.relpartbound, c.oid),
       c.reltuples::bigint, pg_total_relation_size(c.oid), pg_table_size(c.oid),
       pg_indexes_size(c.oid)
  FROM pg_partition_tree('events') t
  JOIN pg_class c ON c.oid = t.relid
  JOIN pg_class p ON p.oid = t.parentrelid
 WHERE t.isleaf
 ORDER BY c.relname = 'events_kept' DESC, c.oid
"""


def _partition_sizes(conn: sa.Connection) -> list[PartitionSize]:
    out = []
    for name, expiring, bound, rows, total, table, indexes in conn.exec_driver_sql(
        _PARTITION_SIZES
    ).all():
        found = _BOUNDS.search(bound or "") if expiring else None
        lo, hi = (int(found[1]), int(found[2])) if found is not None else (None, None)
        out.append(PartitionSize(str(name), bool(expiring), lo, hi, int(rows), int(total),
                                 int(table), int(indexes)))  # fmt: skip
    return sorted(out, key=lambda p: (p.expiring, p.lo or 0))


@dataclass(frozen=True, slots=True)
class Span:
    """A partition of observations: positions ``[lo, hi)``, its rows and size, and when its
    newest row was recorded (None: it has none)."""

    name: str
    lo: int
    hi: int
    rows: int
    total_bytes: int
    newest_at: datetime | None


@dataclass(frozen=True, slots=True)
class Retention:
    """What ``PostgresEventStore.retain`` dropped (or, ``dry_run``, would drop)."""

    older_than: datetime
    dropped: list[Span]
    #: Rows of the dropped spans moved to ``events_kept`` first (or that would be).
    pinned: int
    #: The spans left.
    kept: list[Span]
    dry_run: bool


def _quoted(name: str) -> str:
    if not re.fullmatch(r"events_expiring_\d+", name):
        raise ValueError(f"not a span of the log: {name!r}")
    return f'"{name}"'


def _span_of(conn: sa.Connection, lo: int, hi: int, name: str) -> Span:
    rows, newest, total = conn.exec_driver_sql(
        f"SELECT count(*), max(recorded_at), pg_total_relation_size('{_quoted(name)}')"
        f" FROM {_quoted(name)}"
    ).one()
    return Span(name, lo, hi, int(rows), int(total), newest)


#: Steps a pinned step record stands for (see ``_PINS``): a quarter of the lead the fold
#: allows a report over the job's newest step (``MAX_STEP_LEAD``).
PIN_STEPS = MAX_STEP_LEAD // 4

#: What of a span retention keeps (moving it to ``events_kept``), and the statement that does
#: it (``action``): each process's first and last step record of each generation in the span
#: (a generation's first step resolves its incident: the timeline's last point; the last is
#: the member's and the job's step when it ended), the first step record of each job's
#: generation in every ``PIN_STEPS`` steps (so a kept report of any step is never more than
#: the fold's ``MAX_STEP_LEAD`` ahead of the newest step it folded), each job's last interval
#: summary in the span (every part; the members' last heartbeats when the job ended), and
#: whatever a kept ``fault.detected`` cites as evidence.
_PINS = """
WITH steps AS (
    SELECT position, job_id, source, incarnation, generation,
           (payload->>'step')::bigint / {every} AS bucket
      FROM {leaf} WHERE type = 'train.step'
), pinned AS (
    SELECT position FROM (
        SELECT DISTINCT ON (job_id, source, incarnation, generation) position FROM steps
         ORDER BY job_id, source, incarnation, generation, position) AS first
    UNION
    SELECT position FROM (
        SELECT DISTINCT ON (job_id, source, incarnation, generation) position FROM steps
         ORDER BY job_id, source, incarnation, generation, position DESC) AS last
    UNION
    SELECT position FROM (
        SELECT DISTINCT ON (job_id, generation, bucket) position FROM steps
         ORDER BY job_id, generation, bucket, position) AS every
    UNION
    SELECT position FROM (
        SELECT DISTINCT ON (job_id, payload->>'part') position FROM {leaf}
         WHERE type = 'liveness.summary'
         ORDER BY job_id, payload->>'part', position DESC) AS summaries
    UNION
    SELECT (evidence->>'position')::bigint FROM events_kept f
     CROSS JOIN LATERAL jsonb_array_elements(f.payload->'evidence') AS evidence
     WHERE f.type = 'fault.detected' AND f.position >= {lo}
       AND jsonb_typeof(evidence->'position') = 'number'
       AND (evidence->>'position')::bigint >= {lo} AND (evidence->>'position')::bigint < {hi}
)
{action}
"""
#: Rows move to ``events_kept`` by an update of their class through the partitioned table;
#: one whose event_id is there already (an id reused) is left to go with its span.
_PIN_UPDATE = """
, moved AS (
    UPDATE events e SET expiring = false FROM pinned
     WHERE e.expiring AND e.position >= {lo} AND e.position < {hi}
       AND e.position = pinned.position
       AND NOT EXISTS (SELECT 1 FROM events_kept k WHERE k.event_id = e.event_id)
    RETURNING 1
)
SELECT count(*) FROM moved
"""

_PIN_COUNT = """
SELECT count(*) FROM events e JOIN pinned ON e.position = pinned.position
 WHERE e.expiring AND e.position >= {lo} AND e.position < {hi}
   AND NOT EXISTS (SELECT 1 FROM events_kept k WHERE k.event_id = e.event_id)
"""

#: Spans left half done by a retention interrupted: detached but not dropped, or detaching.
_LEFT_OVER = """
SELECT c.relname, EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = current_schema() AND c.relkind = 'r'
   AND c.relname ~ '^events_expiring_[0-9]+$'
   AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid AND NOT i.inhdetachpending)
"""


def _drop_span(engine: Engine, name: str) -> None:
    """Detach span ``name`` concurrently (no lock that stops readers or appends; it waits for
    the transactions that may read it), then drop it. Each statement on its own: a
    concurrent detach cannot run inside a transaction."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(
            f"ALTER TABLE events_expiring DETACH PARTITION {_quoted(name)} CONCURRENTLY"
        )
        conn.exec_driver_sql(f"DROP TABLE {_quoted(name)}")


def _finish_interrupted(engine: Engine) -> None:
    """Finish what an interrupted retention left: a detach still pending is finalized, and a
    detached span dropped."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for name, pending in conn.exec_driver_sql(_LEFT_OVER).all():
            if pending:
                conn.exec_driver_sql(
                    f"ALTER TABLE events_expiring DETACH PARTITION {_quoted(name)} FINALIZE"
                )
            conn.exec_driver_sql(f"DROP TABLE {_quoted(name)}")


def catalog_reports(payloads: Iterable[Any]) -> Iterator[tuple[str, str, int]]:
    """(source, incarnation, seq) of every report in ``payloads`` (stored ``backup.catalog``
    payloads, either version, as the driver returns them)."""
    for payload in payloads:
        body = PackedCatalog.model_validate(payload, strict=False) if "packed" in payload else (
            BackupCatalog.model_validate(payload, strict=False))  # fmt: skip
        columns = body.columns()
        yield from zip(columns.sources, columns.incarnations, columns.seqs, strict=True)


#: The members' own rows of job ``%(job)s``: (source, incarnation, seq).
MEMBER_ROWS = (
    "SELECT source, incarnation, seq FROM events WHERE job_id = %(job)s"
    " AND source <> 'controlplane'"
)
#: Every catalog the store recorded: its payload (of job ``%(job)s``; None: of every job).
CATALOG_PAYLOADS = (
    "SELECT payload FROM events WHERE type = 'backup.catalog' AND source = 'controlplane'"
    " AND (%(job)s::text IS NULL OR job_id = %(job)s)"
)


def member_event_counts(
    rows: Iterable[tuple[str, str, int]], payloads: Iterable[Any]
) -> tuple[int, int]:
    """(events, distinct (source, incarnation, seq)) the members of a job have in the log:
    their own rows (``MEMBER_ROWS``) and the reports the store packed into catalogs
    (``CATALOG_PAYLOADS``), each report counted once. What a bench checks for lost and
    duplicated events."""
    keys = [(str(s), str(i), int(q)) for s, i, q in rows]
    keys.extend(catalog_reports(payloads))
    return len(keys), len(set(keys))


def count_member_events(conn: psycopg.Connection[Any], job_id: str) -> tuple[int, int]:
    """``member_event_counts`` of job ``job_id`` read over ``conn``."""
    params = {"job": job_id}
    rows = conn.execute(MEMBER_ROWS, params).fetchall()
    payloads = [r[0] for r in conn.execute(CATALOG_PAYLOADS, params).fetchall()]
    return member_event_counts(rows, payloads)


# ---------------------------------------------------------------------- the append transaction
#
# One transaction, written once as a generator of steps and run by a sync or an asyncio driver:
# lock the head row (the single-writer rule), apply the sequence rules against the cursors,
# COPY the accepted events with consecutive positions, move cursors and head, record gaps and
# dead letters. Only events at or below their source's highest seq are looked up by event_id;
# a reused event_id under a new seq surfaces as a unique violation and is skipped. The reads
# before the COPY go in one round trip, and so do the writes after it with the commit
# (``_Batch``, in libpq's pipeline mode): a 4,096-rank decision's append made ten round trips.


@dataclass(frozen=True, slots=True)
class _Query:
    sql: str
    params: Any = None
    fetch: str = "none"  # none | one | all | rowcount
    #: Parameters in binary (bytea as bytes, not hex text: dead letters' raw bytes).
    binary: bool = False


@dataclass(frozen=True, slots=True)
class _Copy:
    sql: str
    data: bytes
    #: A unique violation is sent back as ``_CONFLICT`` instead of raised.
    may_conflict: bool = False


@dataclass(frozen=True, slots=True)
class _Batch:
    """Statements sent together, in one round trip where libpq can pipeline them (their
    results come back as a list, in order); ``commit``: the transaction's last statements,
    committed with them."""

    queries: tuple[_Query, ...]
    commit: bool = False


_CONFLICT = object()


_Step = _Query | _Copy | _Batch
_Steps = Generator[_Step, Any, AppendResult]


def encode_row(event: EnvelopeBase, _to_json: Any = to_json) -> bytes:
    """The COPY text of an event's columns after ``position`` and ``recorded_at``.

    Pure CPU work, done by the ingest while decoding so the writer's transaction stays short.
    The time and the payload are serialized together in one call into pydantic-core (the
    payload by its model's serializer, aliases included): ``["<emitted_at>",{payload}]``.
    The other columns are pattern-bound identifiers and integers, nothing COPY must escape.
    """
    pair: bytes = _to_json((event.emitted_at, event.payload))
    split = pair.index(b'",', 2)
    payload = pair[split + 2 : -1]
    # COPY text format: backslash is special. JSON escapes tab, newline and CR itself.
    if b"\\" in payload:
        payload = payload.replace(b"\\", b"\\\\")
    return b"%s\t%s\t%s\t%d\t%s\t%s\t%d\t%d\t%s\t%s" % (
        event.event_id.encode(),
        event.job_id.encode(),
        event.type.encode(),
        event.v,
        event.source.encode(),
        event.incarnation.encode(),
        event.seq,
        event.generation,
        pair[2:split],
        payload,
    )


def _copy_data(
    head: int,
    now: datetime,
    rows: Sequence[bytes],
    flags: Sequence[bool],
    stamps: Sequence[datetime] | None = None,
) -> bytes:
    """COPY text of ``rows`` at the positions after ``head``, each with its class (``flags``:
    ``is_expiring``) and its recording time (``now``, or ``stamps`` for an import)."""
    marks = [b"t" if f else b"f" for f in flags]
    if stamps is not None:  # an import: each event keeps the time it was first recorded at
        return b"".join(
            b"%d\t%s\t%s\t%s\n" % (p, t.isoformat().encode(), f, r)
            for p, (t, f, r) in enumerate(zip(stamps, marks, rows, strict=True), start=head + 1)
        )
    stamp = now.isoformat().encode()
    return b"".join(
        b"%d\t%s\t%s\t%s\n" % (p, stamp, f, r)
        for p, (f, r) in enumerate(zip(marks, rows, strict=True), start=head + 1)
    )


def is_expiring(event: EnvelopeBase) -> bool:
    """Whether ``event`` is an observation a retention policy may drop (``events_expiring``):
    a step record, or an interval liveness summary. Everything else is kept: decisions,
    faults, incidents, members' reports, backup catalogs, and the summaries a decision read
    (reason ``decision``)."""
    kind = event.type
    if kind == "train.step":
        return True
    return kind == "liveness.summary" and event.payload.reason == "interval"


@dataclass(frozen=True, slots=True)
class SpanPolicy:
    """How wide the store makes each span of ``events_expiring`` it opens: as many positions
    as the log took ``span_s`` to fill at the rate it grew over the span before (within
    ``min_rows`` and ``max_rows``), so that a span is about ``span_s`` of the log and
    retention drops observations ``span_s`` at a time."""

    span_s: float = 86_400.0
    min_rows: int = 1_000
    max_rows: int = 100_000_000
    #: A span filled faster than this is taken as filled in this long (a burst, an import).
    min_elapsed_s: float = 60.0


_BOUNDS = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")


def _parse_spans(rows: Iterable[Any]) -> list[tuple[int, int, str]]:
    """(lo, hi, name) of each span (``_SPANS``' rows), in position order."""
    out = []
    for name, bound in rows:
        found = _BOUNDS.search(bound or "")
        if found is not None:
            out.append((int(found[1]), int(found[2]), str(name)))
    return sorted(out)


class SpanCache:
    """The spans of ``events_expiring`` a writer knows: which positions have a partition.
    Spans are opened only under the ``log_head`` row lock (``_ensure_spans``), so what is kept
    can only lag: a bound found too low is read again before a span is opened."""

    def __init__(self, policy: SpanPolicy | None = None) -> None:
        self.policy = policy or SpanPolicy()
        #: (lo, hi) of every span, in order; None: not read yet.
        self.spans: list[tuple[int, int]] | None = None

    @property
    def bound(self) -> int:
        """The first position no span covers (0: none known)."""
        return self.spans[-1][1] if self.spans else 0

    def checked_from(self, position: int) -> int:
        """Where the de-duplication of observations starts for a row at ``position``: the
        start of the span before the one that holds it (its own unique index checks its own)."""
        spans = self.spans or []
        starts = [lo for lo, hi in spans if lo <= position]
        return starts[-2] if len(starts) >= 2 else (starts[-1] if starts else 0)


def _span_ddl(lo: int, hi: int) -> list[str]:
    """The statements that open span [lo, hi): its table, its unique index on ``event_id``,
    then attached (``ATTACH`` takes only a SHARE UPDATE EXCLUSIVE lock on the parent, so
    readers and writers of the log go on; ``CREATE TABLE ... PARTITION OF`` would wait for
    every reader)."""
    name = f"events_expiring_{lo}"
    return [
        f"CREATE TABLE {name} (LIKE events_expiring INCLUDING DEFAULTS INCLUDING STORAGE)",
        f"CREATE UNIQUE INDEX {name}_event_id ON {name} (event_id)",
        f"ALTER TABLE events_expiring ATTACH PARTITION {name} FOR VALUES FROM ({lo}) TO ({hi})",
    ]


def _ensure_spans(
    head: int, last: int, now: datetime, cache: SpanCache
) -> Generator[_Step, Any, None]:
    """Steps that open spans of ``events_expiring`` until position ``last`` has one: run
    under the ``log_head`` row lock, so no other writer opens one meanwhile. Nothing is sent
    while the cache says ``last`` is covered."""
    if cache.spans is not None and last < cache.bound:
        return
    rows = yield _Query(_SPANS, fetch="all")
    cache.spans = [(lo, hi) for lo, hi, _ in _parse_spans(rows)]
    if last < cache.bound:
        return
    policy = cache.policy
    width = policy.min_rows
    if cache.spans:
        lo = cache.spans[-1][0]
        row = yield _Query(_FIRST_AT, (lo,), fetch="one")
        if row is not None and head >= lo:
            elapsed = max(policy.min_elapsed_s, (now - row[0]).total_seconds())
            rate = (head + 1 - lo) / elapsed
            width = round(min(policy.max_rows, max(policy.min_rows, rate * policy.span_s)))
    # A lock the attach waits for (a retention detaching a span) fails the append after 2 s
    # (class 55: unavailable, so the batch is tried again) instead of holding the log.
    yield _Query("SET LOCAL lock_timeout = '2s'")
    start = max(cache.bound, head + 1)
    while start <= last:
        for statement in _span_ddl(start, start + width):
            yield _Query(statement)
        cache.spans.append((start, start + width))
        start += width


class CursorCache:
    """The source cursors one long-lived writer has read or written (``AsyncAppender``, the
    ingest's), so that an append reads from ``source_cursors`` only those it lacks.

    Valid while the ``log_head`` row is the version the writer's last transaction left: every
    transaction that stores an event or moves a cursor moves the head too (``_append_steps``),
    so the row's ``xmin`` names the last one. Another writer in between (an import, a second
    store) leaves another ``xmin``: the cache is then dropped and every cursor the batch needs
    is read. With 4,096 ranks heartbeating, a commit held ~200 events from ~200 sources, and
    reading their cursors took a third of its time (``bench decide``).
    """

    #: Beyond this many cursors the cache starts again (they are read back as needed).
    MAX_CURSORS = 1 << 20

    def __init__(self) -> None:
        #: The head row's ``xmin`` the cursors are valid for; None: nothing is known.
        self.token: str | None = None
        self.cursors: dict[CursorKey, Cursor] = {}

    def clear(self) -> None:
        """Forget everything (after a failed transaction, or a lost connection)."""
        self.token = None
        self.cursors = {}

    def settle(self, token: str, valid: bool, cursors: Mapping[CursorKey, Cursor]) -> None:
        """After a commit: ``cursors`` are the table's as of ``token`` (the head row's
        ``xmin`` now); ``valid`` when what was kept is still the table's too."""
        if not valid or len(self.cursors) > self.MAX_CURSORS:
            self.cursors = {}
        self.cursors.update(cursors)
        self.token = token


def _cursor_rows(rows: Iterable[Any]) -> dict[CursorKey, Cursor]:
    return {(j, src, i): Cursor(q, tuple((lo, hi) for lo, hi in h)) for j, src, i, q, h in rows}


def _key_columns(keys: Sequence[CursorKey]) -> list[list[str]]:
    return [list(col) for col in zip(*keys, strict=True)]


def _append_steps(
    events: Sequence[EnvelopeBase],
    dead_letters: Sequence[DeadLetter],
    expected: JobHead | None,
    encoded: Sequence[bytes] | None,
    *,
    recorded_at: Mapping[str, datetime] | None = None,
    cache: CursorCache | None = None,
    spans: SpanCache,
) -> _Steps:
    """The append transaction; with ``recorded_at`` (event_id -> time) an import that keeps
    each event's original recording time instead of stamping the batch with ``now``; with
    ``cache``, the cursors it holds are not read again while they are valid; ``spans``: the
    partitions of observations the writer knows (a new one is opened when the log reaches
    the last one's end)."""
    batch = unique(events, encoded)
    keys = list({(e.job_id, e.source, e.incarnation) for e in batch.events})
    cached: dict[CursorKey, Cursor] = {}
    if cache is not None and cache.token is not None:
        held = cache.cursors
        cached = {k: c for k in keys if (c := held.get(k)) is not None}
    wanted = [k for k in keys if k not in cached] if cached else keys
    # What the transaction reads first goes in one round trip: the head row's lock, then
    # (each statement with its own snapshot, taken once the lock is held) the job's head
    # and the sources' cursors; and the savepoint a conflicting COPY rolls back to.
    opening = [_Query(_LOCK_HEAD, fetch="one")]
    if expected is not None:
        opening.append(_Query(_JOB_HEAD, (expected.job_id, expected.position), fetch="one"))
    if wanted:
        opening.append(_Query(_SELECT_CURSORS, _key_columns(wanted), fetch="all"))
    if batch.events:
        opening.append(_Query("SAVEPOINT append_copy"))
    results = iter((yield _Batch(tuple(opening))))
    row = next(results)
    if row is None:
        raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
    head, now, token = row
    if expected is not None:
        row = next(results)
        last = row[0] if row is not None else 0
        if last != expected.position:
            raise ConcurrencyError(
                f"job {expected.job_id} is at {last}, writer expected {expected.position}"
            )
        if expected.log is not None and head != expected.log:
            raise ConcurrencyError(
                f"the log is at {head}, writer expected {expected.log}", log_head=head
            )
    read = _cursor_rows(next(results)) if wanted else {}
    valid = cache is not None and token == cache.token
    if cached and not valid:
        # Another writer came in between: what the cache held is read again.
        again = yield _Query(_SELECT_CURSORS, _key_columns(list(cached)), fetch="all")
        read.update(_cursor_rows(again))
        cached = {}
    cursors = {**cached, **read} if cached else read
    sequenced = sequence(batch.events, cursors)
    known: set[str] = set()
    if sequenced.stale:
        rows = yield _Query(_KNOWN_IDS, ([e.event_id for e, _ in sequenced.stale],), fetch="all")
        known = {str(r[0]) for r in rows}
    duplicates, refused = split_stale(sequenced, known)

    # Runs of backup reports are packed into one record each (``core.catalog``); every other
    # event is stored as it came, pre-encoded when the batch was.
    wire = batch.encoded
    at = sequenced.accepted_at
    packed = pack(sequenced.accepted)
    accepted = [e for e, _ in packed]
    # (A report is not pre-encoded, ``AsyncAppender.encode``: one left alone in its run is
    # encoded here.)
    encoded_rows = [
        (wire[at[i]] or encode_row(e)) if wire is not None and e.type != CATALOG else encode_row(e)
        for e, i in packed
    ]
    # An import keeps each event's recording time; a catalog takes its first report's.
    if recorded_at is not None:
        firsts = {e.event_id: sequenced.accepted[i].event_id for e, i in packed}
        recorded_at = {e: recorded_at[first] for e, first in firsts.items()}

    def stamps() -> list[datetime] | None:
        return None if recorded_at is None else [recorded_at[e.event_id] for e in accepted]

    flags = [is_expiring(e) for e in accepted]
    if any(flags):
        # Every position of the batch has a span (opened here when the log reached the last
        # one's end), and an observation's id is unique in its span and the one before:
        # each span's unique index sees only itself.
        yield from _ensure_spans(head, head + len(accepted), now, spans)
        ids = [e.event_id for e, f in zip(accepted, flags, strict=True) if f]
        start = spans.checked_from(head + 1)
        rows = yield _Query(_KNOWN_EXPIRING, (ids, start), fetch="all")
        if rows:
            accepted, encoded_rows, flags, dropped = _without(rows, accepted, encoded_rows, flags)
            duplicates += dropped

    closing: list[_Query] = []
    if accepted:
        outcome = yield _Copy(
            _COPY_EVENTS, _copy_data(head, now, encoded_rows, flags, stamps()), may_conflict=True
        )
        if outcome is _CONFLICT:
            # An accepted event's id is in the log already (reused under a new seq): skip it.
            yield _Query("ROLLBACK TO SAVEPOINT append_copy")
            rows = yield _Query(_KNOWN_IDS, ([e.event_id for e in accepted],), fetch="all")
            accepted, encoded_rows, flags, dropped = _without(rows, accepted, encoded_rows, flags)
            duplicates += dropped
            if accepted:
                yield _Copy(_COPY_EVENTS, _copy_data(head, now, encoded_rows, flags, stamps()))
    # Whenever events or cursors change (even when every accepted event proved a duplicate),
    # the head moves, so that the head row's xmin names this transaction (``CursorCache``).
    moved = bool(accepted or sequenced.cursors)
    if moved:
        closing.append(_Query(_MOVE_HEAD, (head + len(accepted),), fetch="one"))
    times = stamps()
    if times is None:
        stored = [StoredEvent(head + i, now, e) for i, e in enumerate(accepted, start=1)]
    else:
        pairs = zip(times, accepted, strict=True)
        stored = [StoredEvent(head + i, t, e) for i, (t, e) in enumerate(pairs, start=1)]
    if sequenced.cursors:
        jobs, sources, incarnations = (list(c) for c in zip(*sequenced.cursors, strict=True))
        values = sequenced.cursors.values()
        closing.append(
            _Query(
                _UPSERT_CURSORS,
                (
                    now,
                    jobs,
                    sources,
                    incarnations,
                    [c.last_seq for c in values],
                    [json.dumps(c.holes) for c in values],
                ),
            )
        )
    # Gaps and dead letters: one statement each, sent on their own (not in the pipeline
    # below: libpq's pipeline stalled on a statement with megabytes of parameters). Only a
    # batch with gaps or dead letters pays the round trips.
    if sequenced.gaps:
        columns = [list(c) for c in zip(*gap_rows(sequenced.gaps), strict=True)]
        yield _Query(_INSERT_GAP, (now, *columns))
    # Whatever a letter holds, its text columns are made storable (no NUL, no surrogate).
    letters = [storable(d) for d in (*dead_letters, *refused_letters(refused))]
    added = 0
    if letters:
        columns = [
            [d.stream_seq for d in letters], [d.event_id for d in letters],
            [d.subject for d in letters], [d.job_id for d in letters],
            [d.raw for d in letters], [d.reason for d in letters],
        ]  # fmt: skip
        added = yield _Query(_INSERT_DEAD, (now, *columns), fetch="rowcount", binary=True)
    # The writes after the COPY and the commit: one round trip.
    results = yield _Batch(tuple(closing), commit=True)
    if cache is not None:
        cache.settle(results[0][0] if moved else token, valid, {**read, **sequenced.cursors})
    return AppendResult(
        stored=stored,
        duplicates=batch.repeats + duplicates,
        rejected=refused,
        dead_letters=added,
        gaps=sequenced.gaps,
        late=sequenced.late,
    )


#: libpq 14 and later pipeline (psycopg's binary package brings its own, 17 or later).
_PIPELINE = psycopg.Pipeline.is_supported()


def _without(
    known: Sequence[Any],
    accepted: list[EnvelopeBase],
    encoded_rows: list[bytes],
    flags: list[bool],
) -> tuple[list[EnvelopeBase], list[bytes], list[bool], int]:
    """The accepted events (their rows and flags alike) without those whose ids the rows
    ``known`` name; and how many were dropped."""
    ids = {str(r[0]) for r in known}
    kept = [i for i, e in enumerate(accepted) if e.event_id not in ids]
    return (
        [accepted[i] for i in kept],
        [encoded_rows[i] for i in kept],
        [flags[i] for i in kept],
        len(accepted) - len(kept),
    )


def _run_sync(conn: psycopg.Connection[Any], steps: _Steps) -> AppendResult:
    """Run the append transaction ``steps`` on ``conn`` up to its commit."""
    result: Any = None
    try:
        while True:
            step = steps.send(result)
            if isinstance(step, _Batch):
                result = _batch_sync(conn, step)
                continue
            with conn.cursor() as cur:
                if isinstance(step, _Copy):
                    try:
                        with cur.copy(step.sql) as copy:
                            copy.write(step.data)
                        result = None
                    except psycopg.errors.UniqueViolation:
                        if not step.may_conflict:
                            raise
                        result = _CONFLICT
                    continue
                cur.execute(step.sql, step.params, binary=step.binary)
                result = _fetched(cur, step.fetch)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _batch_sync(conn: psycopg.Connection[Any], batch: _Batch) -> list[Any]:
    cursors = [conn.cursor() for _ in batch.queries]
    try:
        with conn.pipeline() if _PIPELINE else nullcontext():
            for cur, query in zip(cursors, batch.queries, strict=True):
                cur.execute(query.sql, query.params)
            if batch.commit:
                conn.commit()
        return [_fetched(c, q.fetch) for c, q in zip(cursors, batch.queries, strict=True)]
    finally:
        for cur in cursors:
            cur.close()


def _fetched(cur: Any, fetch: str) -> Any:
    if fetch == "one":
        return cur.fetchone()
    if fetch == "all":
        return cur.fetchall()
    if fetch == "rowcount":
        return cur.rowcount
    return None


class AsyncAppender:
    """Appends from an asyncio loop over one psycopg async connection (the ingest's writer).

    Same transaction and contract as ``PostgresEventStore.append``; no thread, so the event
    loop keeps fetching and decoding while PostgreSQL works. Connects lazily, reconnects
    after a failure. Keeps the cursors of the sources it appended for (``CursorCache``).
    """

    def __init__(self, database_url: str, *, spans: SpanPolicy | None = None) -> None:
        self._url = libpq_url(database_url)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.cursors = CursorCache()
        self.spans = SpanCache(spans)

    async def close(self) -> None:
        """Close the connection."""
        self.cursors.clear()
        self.spans.spans = None
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        """See ``EventStore.append``."""
        if not events and not dead_letters:
            return AppendResult()
        steps = _append_steps(
            events, dead_letters, expected, encoded, cache=self.cursors, spans=self.spans
        )
        try:
            with translated():
                if self._conn is None or self._conn.closed:
                    self._conn = await psycopg.AsyncConnection.connect(self._url)
                conn = self._conn
                try:
                    result = await _run_async(conn, steps)
                    await conn.commit()  # committed by the last step already
                except BaseException as exc:
                    self.cursors.clear()
                    self.spans.spans = None  # a span opened in the failed transaction is not
                    if isinstance(exc, psycopg.Error):
                        # A failed statement can leave libpq in pipeline mode with results
                        # it still waits for ("cannot exit pipeline mode while busy"): the
                        # next batch starts on a new connection.
                        self._conn = None
                        await conn.close()
                    elif not conn.closed:
                        await conn.rollback()
                    raise
        except StoreUnavailable:
            await self.close()
            raise
        return result

    def encode(self, events: Sequence[EnvelopeBase]) -> list[bytes]:
        """Pre-encode events for ``append(encoded=...)`` (see ``encode_row``). A backup report
        is left empty (``b""``): the append packs it into a catalog, whose row it encodes
        itself (one left alone in its run is encoded then), so encoding each of a backup's
        16,384 reports ahead was work thrown away."""
        return [b"" if e.type == PACKED else encode_row(e) for e in events]


async def _run_async(conn: psycopg.AsyncConnection[Any], steps: _Steps) -> AppendResult:
    """``_run_sync`` on an asyncio connection."""
    result: Any = None
    try:
        while True:
            step = steps.send(result)
            if isinstance(step, _Batch):
                result = await _batch_async(conn, step)
                continue
            async with conn.cursor() as cur:
                if isinstance(step, _Copy):
                    try:
                        async with cur.copy(step.sql) as copy:
                            await copy.write(step.data)
                        result = None
                    except psycopg.errors.UniqueViolation:
                        if not step.may_conflict:
                            raise
                        result = _CONFLICT
                    continue
                await cur.execute(step.sql, step.params, binary=step.binary)
                result = await _fetched_async(cur, step.fetch)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _batch_async(conn: psycopg.AsyncConnection[Any], batch: _Batch) -> list[Any]:
    cursors = [conn.cursor() for _ in batch.queries]
    try:
        async with conn.pipeline() if _PIPELINE else nullcontext():
            for cur, query in zip(cursors, batch.queries, strict=True):
                await cur.execute(query.sql, query.params)
            if batch.commit:
                await conn.commit()
        return [
            await _fetched_async(c, q.fetch) for c, q in zip(cursors, batch.queries, strict=True)
        ]
    finally:
        for cur in cursors:
            await cur.close()


async def _fetched_async(cur: psycopg.AsyncCursor[Any], fetch: str) -> Any:
    if fetch == "one":
        return await cur.fetchone()
    if fetch == "all":
        return await cur.fetchall()
    if fetch == "rowcount":
        return cur.rowcount
    return None


def _to_stored(row: Any) -> StoredEvent:
    envelope = {
        "event_id": str(row["event_id"]),
        "job_id": row["job_id"],
        "type": row["type"],
        "v": row["v"],
        "source": row["source"],
        "incarnation": row["incarnation"],
        "seq": row["seq"],
        "generation": row["generation"],
        "emitted_at": row["emitted_at"],
        "payload": row["payload"],
    }
    # Stored rows were validated on the way in; lax mode accepts the driver's native types.
    event = EVENT_ADAPTER.validate_python(envelope, strict=False)
    return StoredEvent(int(row["position"]), row["recorded_at"], event)


__all__ = ["AsyncAppender", "PostgresEventStore", "make_engine"]
