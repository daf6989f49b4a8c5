"""The PostgreSQL event store: batched, idempotent, gap-free appends with COPY.

One append is one transaction: lock the ``log_head`` row (the single-writer rule that keeps
positions gap-free and in commit order), drop event_ids already stored, apply the sequence
rules, COPY the new rows, move the cursors and the head, record dead letters, commit.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from pydantic_core import to_json
from sqlalchemy import Engine, create_engine
from sqlalchemy.dialects.postgresql import insert as pg_insert

from controlplane.core.catalog import CATALOG, pack, unpacked
from controlplane.core.records import DeadLetter, StoredEvent
from controlplane.core.sequence import Cursor, CursorKey, SeqGap, sequence
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
from schemas.events import EVENT_ADAPTER, EnvelopeBase

#: The head row's ``xmin`` names the last transaction that wrote to the log or the cursors
#: (every one moves the head, see ``_append_steps``): a ``CursorCache``'s check.
_LOCK_HEAD = "SELECT position, clock_timestamp(), xmin::text FROM log_head WHERE id = 1 FOR UPDATE"
_JOB_HEAD = "SELECT coalesce(max(position), 0) FROM events WHERE job_id = %s"
_COPY_EVENTS = (
    "COPY events (position, recorded_at, event_id, job_id, type, v, source, incarnation, seq,"
    " generation, emitted_at, payload) FROM STDIN"
)
_KNOWN_IDS = "SELECT event_id::text FROM events WHERE event_id = ANY(%s::uuid[])"
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
    """The system of record. Construction does no I/O; the engine connects on first use."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(cls, database_url: str) -> PostgresEventStore:
        """A store over a new engine for ``database_url``."""
        return cls(make_engine(database_url))

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
        steps = _append_steps(events, dead_letters, expected, encoded)
        with self._raw() as conn:
            result = _run_sync(conn, steps)
            conn.commit()  # committed by the last step already; nothing left to send
        return result

    def import_events(self, events: Sequence[StoredEvent]) -> AppendResult:
        """See ``EventStore.import_events``."""
        if not events:
            return AppendResult()
        events = list(unpacked(events))
        recorded_at: dict[str, datetime] = {}
        for stored in events:
            recorded_at.setdefault(stored.event.event_id, stored.recorded_at)
        steps = _append_steps([s.event for s in events], (), None, None, recorded_at=recorded_at)
        with self._raw() as conn:
            result = _run_sync(conn, steps)
            conn.commit()  # committed by the last step already; nothing left to send
        return result

    def appender(self) -> AsyncAppender:
        """An asyncio appender over its own connection to the same database."""
        return AsyncAppender(self.engine.url.render_as_string(hide_password=False))

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
        """What the log takes on disk, and each job's part of it, by event type. A full scan
        of the events (an operator's command, not a service's query)."""
        by_type = sa.text(
            "SELECT job_id, type, count(*), sum(pg_column_size(e.*))::bigint,"
            " min(recorded_at), max(recorded_at) FROM events e GROUP BY job_id, type"
        )
        sizes = sa.text(
            "SELECT pg_total_relation_size('events'), pg_table_size('events'),"
            " pg_indexes_size('events'), pg_total_relation_size('dead_letters')"
        )
        with translated(), self.engine.connect() as conn:
            rows = conn.execute(by_type).all()
            total, table, indexes, letters = conn.execute(sizes).one()
        jobs: dict[str, JobStorage] = {}
        for job, type_, count, row_bytes, first, last in rows:
            entry = jobs.get(job)
            if entry is None:
                entry = jobs[job] = JobStorage(job, 0, 0, first, last, {})
            entry.events += int(count)
            entry.row_bytes += int(row_bytes)
            entry.first_at, entry.last_at = min(entry.first_at, first), max(entry.last_at, last)
            entry.by_type[type_] = (int(count), int(row_bytes))
        return Storage(int(total), int(table), int(indexes), int(letters), list(jobs.values()))

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
    #: The job's rows as PostgreSQL stores them (``pg_column_size`` of each row; no indexes).
    row_bytes: int
    first_at: datetime
    last_at: datetime
    #: Event type -> (events, row bytes).
    by_type: dict[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Storage:
    """The log's size on disk: the events table with its indexes and TOAST, and each job."""

    events_total_bytes: int
    events_table_bytes: int
    events_index_bytes: int
    dead_letters_bytes: int
    jobs: list[JobStorage]

    def share_bytes(self, job: JobStorage) -> int:
        """The job's share of the events table with its indexes, in proportion to its rows
        (every row has the same index entries, give or take its key's length)."""
        rows = sum(j.row_bytes for j in self.jobs)
        return round(self.events_total_bytes * job.row_bytes / rows) if rows else 0


#: (source, incarnation, seq) of every backup report the store packed into a catalog.
CATALOG_REPORTS = """
SELECT s.source, i.incarnation, q.seq::bigint
  FROM events e
 CROSS JOIN LATERAL jsonb_array_elements_text(e.payload->'sources')
       WITH ORDINALITY AS s(source, n)
  JOIN LATERAL jsonb_array_elements_text(e.payload->'incarnations')
       WITH ORDINALITY AS i(incarnation, n) USING (n)
  JOIN LATERAL jsonb_array_elements_text(e.payload->'seqs') WITH ORDINALITY AS q(seq, n)
       USING (n)
 WHERE e.type = 'backup.catalog' AND e.source = 'controlplane'
"""

#: (events, distinct (source, incarnation, seq)) the members of job ``%(job)s`` have in the
#: log: rows of their own and the reports the store packed into catalogs (``core.catalog``),
#: each report counted once. What a bench checks for lost and duplicated events.
MEMBER_EVENT_COUNTS = f"""
SELECT count(*), count(DISTINCT (source, incarnation, seq)) FROM (
    SELECT source, incarnation, seq FROM events
     WHERE job_id = %(job)s AND source <> 'controlplane'
    UNION ALL
    {CATALOG_REPORTS} AND e.job_id = %(job)s
) AS reports
"""


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
    head: int, now: datetime, rows: Sequence[bytes], stamps: Sequence[datetime] | None = None
) -> bytes:
    if stamps is not None:  # an import: each event keeps the time it was first recorded at
        return b"".join(
            b"%d\t%s\t%s\n" % (p, t.isoformat().encode(), r)
            for p, (t, r) in enumerate(zip(stamps, rows, strict=True), start=head + 1)
        )
    stamp = now.isoformat().encode()
    return b"".join(b"%d\t%s\t%s\n" % (p, stamp, r) for p, r in enumerate(rows, start=head + 1))


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
) -> _Steps:
    """The append transaction; with ``recorded_at`` (event_id -> time) an import that keeps
    each event's original recording time instead of stamping the batch with ``now``; with
    ``cache``, the cursors it holds are not read again while they are valid."""
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
        opening.append(_Query(_JOB_HEAD, (expected.job_id,), fetch="one"))
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
    encoded_rows = [
        wire[at[i]] if wire is not None and e.type != CATALOG else encode_row(e) for e, i in packed
    ]
    # An import keeps each event's recording time; a catalog takes its first report's.
    if recorded_at is not None:
        firsts = {e.event_id: sequenced.accepted[i].event_id for e, i in packed}
        recorded_at = {e: recorded_at[first] for e, first in firsts.items()}

    def stamps() -> list[datetime] | None:
        return None if recorded_at is None else [recorded_at[e.event_id] for e in accepted]

    closing: list[_Query] = []
    if accepted:
        outcome = yield _Copy(
            _COPY_EVENTS, _copy_data(head, now, encoded_rows, stamps()), may_conflict=True
        )
        if outcome is _CONFLICT:
            # An accepted event's id is in the log already (reused under a new seq): skip it.
            yield _Query("ROLLBACK TO SAVEPOINT append_copy")
            rows = yield _Query(_KNOWN_IDS, ([e.event_id for e in accepted],), fetch="all")
            known = {str(r[0]) for r in rows}
            kept = [i for i, e in enumerate(accepted) if e.event_id not in known]
            duplicates += len(accepted) - len(kept)
            accepted = [accepted[i] for i in kept]
            encoded_rows = [encoded_rows[i] for i in kept]
            if accepted:
                yield _Copy(_COPY_EVENTS, _copy_data(head, now, encoded_rows, stamps()))
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

    def __init__(self, database_url: str) -> None:
        self._url = libpq_url(database_url)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.cursors = CursorCache()

    async def close(self) -> None:
        """Close the connection."""
        self.cursors.clear()
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
        steps = _append_steps(events, dead_letters, expected, encoded, cache=self.cursors)
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
        """Pre-encode events for ``append(encoded=...)`` (see ``encode_row``)."""
        return [encode_row(e) for e in events]


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
