"""The API's reads of the PostgreSQL log: rows as JSON built by the server, filters on indexes.

A page of events is assembled from the JSON text PostgreSQL renders for each row, so serving
one costs the API a string join, not a model per event. The views' tail reads the whole log by
position (the primary key) and validates each envelope from that JSON text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from json.encoder import encode_basestring as _str
from typing import Any

import psycopg
from sqlalchemy import Engine

from controlplane.core.records import StoredEvent
from controlplane.errors import SchemaNotMigrated, StoreUnavailable
from controlplane.settings import libpq_url
from controlplane.store.postgres import raw_connection, translated
from schemas.events import EVENT_ADAPTER

#: A UTC time as ``2026-01-01T00:00:00.000000Z``.
_UTC = "to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
_ENVELOPE = (
    "'event_id', event_id, 'job_id', job_id, 'type', type, 'v', v, 'source', source,"
    " 'incarnation', incarnation, 'seq', seq, 'generation', generation,"
    f" 'emitted_at', {_UTC.format('emitted_at')}, 'payload', payload"
)


def _iso_utc(column: str) -> str:
    """SQL for a ``timestamptz`` column's text as ``2026-01-01T00:00:20.5`` (add ``Z``): its
    ISO-style text in UTC (``2026-01-01 00:00:20.5+00``, the reader's session settings) with
    a ``T`` for the space and without the offset."""
    return f"left(replace({column}::text, ' ', 'T'), -3)"


#: An event of the job whose id is the first parameter, JSON-encoded, as ``schemas.api.EventOut``
#: JSON, written by PostgreSQL with plain concatenation. The strings are not escaped: ``type``
#: is one of the catalog's names and ``source`` and ``incarnation`` are bound to identifier
#: patterns by the schemas, through which every stored event passed, so none holds a character
#: JSON escapes (``test_api`` reads every event of a page back through ``EventOut``). Numbers
#: and the UUID are their text; the payload is JSONB's own text. Costs the server a little more
#: than sending the columns, and the API (which answers the page on one thread) half as much as
#: building it from them.
_EVENT_JSON = " || ".join(
    [
        "'{\"position\":'", "position",
        "',\"recorded_at\":\"'", _iso_utc("recorded_at"),
        "'Z\",\"event_id\":\"'", "event_id",
        "'\",\"job_id\":'", "%s::text",
        "',\"type\":\"'", "type",
        "'\",\"v\":'", "v",
        "',\"source\":\"'", "source",
        "'\",\"incarnation\":\"'", "incarnation",
        "'\",\"seq\":'", "seq",
        "',\"generation\":'", "generation",
        "',\"emitted_at\":\"'", _iso_utc("emitted_at"),
        "'Z\",\"payload\":'", "payload::text",
        "'}'",
    ]
)  # fmt: skip

_TAIL = (
    f"SELECT position, recorded_at, json_build_object({_ENVELOPE})::text FROM events"
    " WHERE position > %s ORDER BY position LIMIT %s"
)
_HEAD = "SELECT position FROM log_head WHERE id = 1"
#: The member part of ``source`` (``node/member``); index ``events_job_member_position``.
MEMBER_EXPRESSION = "split_part(source, '/', 2)"


@dataclass(frozen=True, slots=True)
class EventQuery:
    """A page of one job's events: position order, after a cursor, optionally filtered."""

    job_id: str
    after: int = 0
    limit: int = 100
    #: Any of these types (empty: every type).
    types: tuple[str, ...] = ()
    #: Events whose source is this member (``<node>/<member>``).
    member: str | None = None
    #: Recorded at or after this time.
    since: datetime | None = None
    #: Recorded before this time.
    until: datetime | None = None


@contextmanager
def _cursor(engine: Engine) -> Iterator[psycopg.Cursor[Any]]:
    with raw_connection(engine) as conn, conn.cursor() as cur:
        yield cur  # the connection goes back to the pool, which ends the read's transaction


def tail(engine: Engine, after: int, limit: int) -> list[StoredEvent]:
    """Up to ``limit`` events of every job with ``position > after``, in position order."""
    with _cursor(engine) as cur:
        rows = cur.execute(_TAIL, (after, limit)).fetchall()
    validate = EVENT_ADAPTER.validate_json
    return [StoredEvent(int(p), at, validate(envelope)) for p, at, envelope in rows]


def _page_sql(query: EventQuery) -> tuple[str, list[Any]]:
    where = ["job_id = %s", "position > %s"]
    params: list[Any] = [_str(query.job_id), query.job_id, query.after]
    if len(query.types) == 1:  # equality keeps the (job_id, type, position) index ordered
        where.append("type = %s")
        params.append(query.types[0])
    elif query.types:
        where.append("type = ANY(%s)")
        params.append(list(query.types))
    if query.member is not None:
        where.append(f"{MEMBER_EXPRESSION} = %s")
        params.append(query.member)
    if query.since is not None:
        where.append("recorded_at >= %s")
        params.append(query.since)
    if query.until is not None:
        where.append("recorded_at < %s")
        params.append(query.until)
    # The limit is written in the statement, not passed: a prepared statement's generic plan
    # assumes a tenth of the rows for a LIMIT it does not know, so PostgreSQL would plan each
    # page again (a custom plan, twice the cost of the page) rather than use it.
    sql = (
        f"SELECT position, {_EVENT_JSON} FROM events WHERE {' AND '.join(where)}"
        f" ORDER BY position LIMIT {int(query.limit) + 1}"
    )
    return sql, params


def _cursor_after(rows: list[tuple[Any, ...]], query: EventQuery) -> tuple[list[str], int | None]:
    limit = query.limit
    more = len(rows) > limit
    return [r[1] for r in rows[:limit]], (int(rows[limit - 1][0]) if more else None)


class PageReader:
    """Pages of events over a few asyncio connections of its own (no thread, no transaction:
    each page is one autocommit query, prepared by psycopg after a few uses).

    The head of the log has a connection of its own: every request waits for the check of the
    head that the views make now and then (``LiveViews.fresh``), and behind page queries that
    fill the other connections it would wait for one of them."""

    def __init__(
        self, database_url: str, *, size: int = 8, statement_timeout_s: float = 10.0
    ) -> None:
        self._url = libpq_url(database_url)
        # Times are written in UTC, ISO style (see ``_iso_utc``); no query runs away.
        self._options = (
            f"-c statement_timeout={int(statement_timeout_s * 1000)}"
            " -c TimeZone=UTC -c DateStyle=ISO"
        )
        self._pages = _Lane(size)
        self._head = _Lane(1)
        self._closed = False

    async def _acquire(self, lane: _Lane) -> _Connection:
        await lane.slots.acquire()
        try:
            if self._closed:
                raise StoreUnavailable("the API is shutting down")
            if lane.idle:
                return lane.idle.pop()
            with translated():
                conn = await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, options=self._options
                )
            return conn, conn.cursor()
        except BaseException:
            lane.slots.release()
            raise

    async def _release(self, lane: _Lane, held: _Connection, *, broken: bool = False) -> None:
        conn = held[0]
        try:
            if broken or self._closed:
                await conn.close()  # a broken or interrupted connection is not reused
            elif not conn.closed:
                lane.idle.append(held)
        finally:
            lane.slots.release()

    async def _fetch(
        self, sql: str, params: Sequence[Any], lane: _Lane | None = None
    ) -> list[tuple[Any, ...]]:
        lane = lane or self._pages
        held = await self._acquire(lane)
        try:
            with translated():
                cursor = held[1]
                await cursor.execute(sql, params)
                rows = await cursor.fetchall()
        except BaseException:
            await self._release(lane, held, broken=True)
            raise
        await self._release(lane, held)
        return rows

    async def page(self, query: EventQuery) -> tuple[list[str], int | None]:
        """The page's events as JSON texts, and the cursor of the next page (None: none yet)."""
        sql, params = _page_sql(query)
        return _cursor_after(await self._fetch(sql, params), query)

    async def head(self) -> int:
        """The log's last position (``log_head``: one row, never waits for a writer)."""
        rows = await self._fetch(_HEAD, (), self._head)
        if not rows:
            raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
        return int(rows[0][0])

    async def close(self) -> None:
        """Close the idle connections (those in use close when they come back)."""
        self._closed = True
        for lane in (self._pages, self._head):
            idle, lane.idle = lane.idle, []
            for conn, _ in idle:
                await conn.close()


#: A connection of a ``PageReader`` and its cursor.
_Connection = tuple[psycopg.AsyncConnection[Any], psycopg.AsyncCursor[Any]]


class _Lane:
    """Connections of a ``PageReader`` for one use: at most ``size`` in use at once."""

    def __init__(self, size: int) -> None:
        self.slots = asyncio.Semaphore(size)
        #: Connections not in use, each with the cursor it runs every query on.
        self.idle: list[_Connection] = []
