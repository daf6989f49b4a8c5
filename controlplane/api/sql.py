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
from psycopg.types.string import TextLoader
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
#: The columns of ``schemas.api.EventOut``, in order, each read as its text (see ``_json``).
_EVENT_COLUMNS = (
    "position, recorded_at, event_id, job_id, type, v, source, incarnation, seq, generation,"
    " emitted_at, payload"
)
#: Read as text, not converted: the page is text again at once.
_TEXT_TYPES = ("int2", "int4", "int8", "timestamptz", "uuid", "jsonb")
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
    params: list[Any] = [query.job_id, query.after]
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
    params.append(query.limit + 1)
    sql = (
        f"SELECT {_EVENT_COLUMNS} FROM events WHERE {' AND '.join(where)}"
        " ORDER BY position LIMIT %s"
    )
    return sql, params


def _time(text: str) -> str:
    """``2026-01-01 00:00:20.5+00`` (ISO style, UTC) as ``"2026-01-01T00:00:20.5Z"``."""
    return f'"{text[:10]}T{text[11:-3]}Z"'


def _json(row: tuple[str, ...]) -> str:
    """One event as ``schemas.api.EventOut`` JSON, from its columns' text.

    Strings are escaped (``encode_basestring``); numbers, the UUID and the payload (JSONB's
    own text) are JSON as PostgreSQL writes them. Building it here costs a tenth of what
    ``json_build_object`` costs the server.
    """
    p, rec, eid, job, typ, v, src, inc, seq, gen, emit, payload = row
    return (
        f'{{"position":{p},"recorded_at":{_time(rec)},"event_id":"{eid}","job_id":{_str(job)},'
        f'"type":{_str(typ)},"v":{v},"source":{_str(src)},"incarnation":{_str(inc)},'
        f'"seq":{seq},"generation":{gen},"emitted_at":{_time(emit)},"payload":{payload}}}'
    )


def _cursor_after(rows: list[tuple[Any, ...]], limit: int) -> tuple[list[str], int | None]:
    more = len(rows) > limit
    rows = rows[:limit]
    return [_json(r) for r in rows], (int(rows[-1][0]) if more else None)


class PageReader:
    """Pages of events over a few asyncio connections of its own (no thread, no transaction:
    each page is one autocommit query, prepared by psycopg after a few uses)."""

    def __init__(
        self, database_url: str, *, size: int = 8, statement_timeout_s: float = 10.0
    ) -> None:
        self._url = libpq_url(database_url)
        # Times are written in UTC, ISO style (see ``_time``); no query runs away.
        self._options = (
            f"-c statement_timeout={int(statement_timeout_s * 1000)}"
            " -c TimeZone=UTC -c DateStyle=ISO"
        )
        self._size = size
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._open = 0
        self._freed = asyncio.Condition()
        self._closed = False

    async def _acquire(self) -> psycopg.AsyncConnection[Any]:
        async with self._freed:
            while not self._idle and self._open >= self._size and not self._closed:
                await self._freed.wait()
            if self._closed:
                raise StoreUnavailable("the API is shutting down")
            if self._idle:
                return self._idle.pop()
            self._open += 1
        try:
            with translated():
                conn = await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True, options=self._options
                )
            for name in _TEXT_TYPES:
                conn.adapters.register_loader(name, TextLoader)
            return conn
        except BaseException:
            await self._release(None)
            raise

    async def _release(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        if conn is not None and self._closed:
            await conn.close()
        async with self._freed:
            if conn is None or conn.closed:
                self._open -= 1
            else:
                self._idle.append(conn)
            self._freed.notify()

    async def _fetch(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        conn = await self._acquire()
        try:
            with translated():
                cur = await conn.execute(sql, params)
                rows = await cur.fetchall()
        except BaseException:
            await conn.close()  # a broken or interrupted connection is not reused
            await self._release(None)
            raise
        await self._release(conn)
        return rows

    async def page(self, query: EventQuery) -> tuple[list[str], int | None]:
        """The page's events as JSON texts, and the cursor of the next page (None: none yet)."""
        sql, params = _page_sql(query)
        return _cursor_after(await self._fetch(sql, params), query.limit)

    async def head(self) -> int:
        """The log's last position (``log_head``: one row, never waits for a writer)."""
        rows = await self._fetch(_HEAD, ())
        if not rows:
            raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
        return int(rows[0][0])

    async def close(self) -> None:
        """Close the idle connections (those in use close when they come back)."""
        async with self._freed:
            idle, self._idle = self._idle, []
            self._closed = True
            self._freed.notify_all()
        for conn in idle:
            await conn.close()
