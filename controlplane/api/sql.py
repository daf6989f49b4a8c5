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
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg_pool import AsyncConnectionPool
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
    """SQL for a ``timestamptz`` column's text as ``2026-01-01T00:00:20.5`` (add ``Z``): the
    ISO-style text (the reader's ``DateStyle``) of its UTC time, with a ``T`` for the space. As
    a ``timestamp`` in UTC it is written without a time zone's conversion or offset, whatever
    the session's ``TimeZone``: PostgreSQL spent about 13% more per page on the ``timestamptz``
    text cut to shape."""
    return f"replace(({column} AT TIME ZONE 'UTC')::text, ' ', 'T')"


#: An event of the job whose id is the first parameter (a ``%s``, JSON-encoded), as
#: ``schemas.api.EventOut`` JSON, written by PostgreSQL with ``concat`` (into one buffer: a
#: chain of ``||`` copies the text so far at each step, and cost PostgreSQL a tenth more per
#: page). The strings are not escaped: ``type`` is one of the catalog's names and ``source``
#: and ``incarnation`` are bound to identifier patterns by the schemas, through which every
#: stored event passed, so none holds a character JSON escapes (``test_api`` reads every event
#: of a page back through ``EventOut``). Numbers and the UUID are their text; the payload is
#: JSONB's own text. Costs the server a little more than sending the columns, and the API
#: (which answers the page on one thread) half as much as building it from them.
_EVENT_JSON = "concat(" + ", ".join(
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
        "'Z\",\"payload\":'", "payload",
        "'}'",
    ]
) + ")"  # fmt: skip

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


@dataclass(frozen=True, slots=True)
class Page:
    """A page of events as the API sends them."""

    #: The events' JSON objects joined by commas: what goes between the brackets of
    #: ``EventPage.events``.
    events: bytes
    #: How many events ``events`` holds.
    count: int
    #: The cursor of the next page (None: no later event matches yet).
    next_after: int | None


def _page_sql(query: EventQuery) -> tuple[str, list[object]]:
    """The page's statement (psycopg's ``%s`` placeholders, in the order they appear) and
    its parameters: one row of the page's events joined (``Page.events``), the events found
    (one more than the page's limit when there is a next page) and the position of the
    page's last event.

    PostgreSQL joins the page's events itself (``string_agg``): the API reads one value, not
    a row per event (psycopg's handling of each row, through its asyncio wait loop, was the
    largest part of a page's cost to the API).

    A page of one type is found in two steps: its positions first, from the index on (job,
    type, position) alone (an index-only scan: the next ``limit + 1`` entries of that type
    after the cursor), then those rows by position, bounded by the cursor and the last of
    them so that PostgreSQL reads only the spans (partitions) that hold them. Asked in one
    step, PostgreSQL reads the log in position order and drops the other types' rows as it
    goes whenever it takes a type for spread evenly over the log (its statistics say how
    common a type is, not where): right after a cursor in an incident of a large job, a page
    of steps sat behind tens of thousands of recovery events and cost several times an
    unfiltered page (docs/benchmarks.md, "The API on a large job's log")."""
    params: list[object] = []  # the filters' (the JSON's own comes first: below)

    def param(value: object) -> str:
        params.append(value)
        return "%s"

    where = [f"job_id = {param(query.job_id)}", f"position > {param(query.after)}"]
    if len(query.types) == 1:  # equality keeps the (job_id, type, position) index ordered
        where.append(f"type = {param(query.types[0])}")
    elif query.types:
        where.append(f"type = ANY({param(list(query.types))})")
    if query.member is not None:
        where.append(f"{MEMBER_EXPRESSION} = {param(query.member)}")
    if query.since is not None:
        where.append(f"recorded_at >= {param(query.since)}")
    if query.until is not None:
        where.append(f"recorded_at < {param(query.until)}")
    # The limit is written in the statement, not passed: a prepared statement's generic plan
    # assumes a tenth of the rows for a LIMIT it does not know, so PostgreSQL would plan each
    # page again (a custom plan, twice the cost of the page) rather than use it.
    limit = int(query.limit)
    found = f"WHERE {' AND '.join(where)} ORDER BY position LIMIT {limit + 1}"
    before: list[object] = []  # placeholders ahead of the JSON's
    first = ""
    if len(query.types) == 1 and query.member is None:
        # The positions first; then those rows, between the cursor and the last of them, so
        # that only the spans of the log (partitions) holding them are read.
        first = f"WITH found AS MATERIALIZED (SELECT position FROM events {found}) "
        before, params = params, [query.after, query.job_id]
        found = (
            "WHERE position > %s AND position <= (SELECT max(position) FROM found)"
            " AND position = ANY(ARRAY(SELECT position FROM found)) AND job_id = %s"
            " ORDER BY position"
        )
    rows = (
        f"SELECT position, {_EVENT_JSON} AS event, row_number() OVER (ORDER BY position) AS n"
        f" FROM events {found}"
    )
    sql = (
        f"{first}SELECT string_agg(event, ',' ORDER BY position) FILTER (WHERE n <= {limit}),"
        f" count(*), max(position) FILTER (WHERE n <= {limit}) FROM ({rows}) page"
    )
    return sql, [*before, _str(query.job_id), *params]


class _Text(Loader):
    """Text columns as the bytes PostgreSQL sent: a page's JSON goes into the answer as is."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    conn.adapters.register_loader("text", _Text)
    conn.prepare_threshold = 0  # every page's shape prepared on its first use
    conn.prepared_max = PREPARED


class PageReader:
    """Pages of events over psycopg's asyncio connection pool (autocommit: each page one
    query, prepared on its first use; no thread, no transaction).

    The head of the log has a pool of its own: every request waits for the check of the head
    that the views make now and then (``LiveViews.fresh``), and behind page queries that fill
    the other connections it would wait for one of them. A connection that breaks is dropped
    by the pool (its page is ``StoreUnavailable``) and replaced on the next page."""

    def __init__(
        self, database_url: str, *, size: int = 8, statement_timeout_s: float = 10.0
    ) -> None:
        url = libpq_url(database_url)
        # Times are written ISO style (see ``_iso_utc``), text is UTF-8, no query runs away.
        options = (
            f"-c statement_timeout={int(statement_timeout_s * 1000)}"
            " -c DateStyle=ISO -c client_encoding=UTF8"
        )

        def pool(size: int, name: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
            return AsyncConnectionPool(
                url, min_size=0, max_size=size, open=False, name=name, configure=_configure,
                kwargs={"autocommit": True, "options": options}, timeout=30.0,
            )  # fmt: skip

        self._pages = pool(size, "api-pages")
        self._head = pool(1, "api-head")
        self._opened = False
        #: Held while the pools open: the first pages may be asked for concurrently.
        self._opening = asyncio.Lock()
        self._closed = False

    async def _open(self) -> None:
        """Open the pools on first use (they need the running loop)."""
        async with self._opening:
            if not self._opened:
                await self._pages.open()
                await self._head.open()
                self._opened = True

    async def _fetch(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        sql: str,
        params: Sequence[object],
    ) -> list[tuple[Any, ...]]:
        if self._closed:
            raise StoreUnavailable("the API is shutting down")
        with translated():
            if not self._opened:
                await self._open()
            async with pool.connection() as conn:
                cursor = await conn.execute(sql, params)
                rows: list[tuple[Any, ...]] = await cursor.fetchall()
                return rows

    async def page(self, query: EventQuery) -> Page:
        """The page of events ``query`` asks for."""
        sql, params = _page_sql(query)
        rows = await self._fetch(self._pages, sql, params)
        events, found, last = rows[0]
        if found > query.limit:
            return Page(events, query.limit, int(last))
        return Page(events or b"", int(found), None)

    async def head(self) -> int:
        """The log's last position (``log_head``: one row, never waits for a writer)."""
        rows = await self._fetch(self._head, _HEAD, ())
        if not rows:
            raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
        return int(rows[0][0])

    async def close(self) -> None:
        """Close the pools (connections in use close when they come back)."""
        self._closed = True
        async with self._opening:
            if self._opened:
                await self._pages.close()
                await self._head.close()


#: Statements a connection of a ``PageReader`` keeps prepared (psycopg's ``prepared_max``).
PREPARED = 64
