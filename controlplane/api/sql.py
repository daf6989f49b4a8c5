"""The API's reads of the PostgreSQL log: rows as JSON built by the server, filters on indexes.

A page of events is assembled from the JSON text PostgreSQL renders for each row, so serving
one costs the API a string join, not a model per event. The views' tail reads the whole log by
position (the primary key) and validates each envelope from that JSON text.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from json.encoder import encode_basestring as _str
from typing import Any, cast

import psycopg
from psycopg import pq
from psycopg.pq.abc import PGconn, PGresult
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


#: An event of the job whose id is the first parameter (``$1``, JSON-encoded), as
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
        "'\",\"job_id\":'", "$1::text",
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


def _array(values: Sequence[str]) -> str:
    """A PostgreSQL array literal of ``values`` (text)."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _page_sql(query: EventQuery) -> tuple[str, list[bytes]]:
    """The page's statement (``$n`` parameters) and its parameters, as text."""
    params: list[bytes] = []

    def param(value: object) -> str:
        params.append(str(value).encode())
        return f"${len(params)}"

    param(_str(query.job_id))  # $1, in _EVENT_JSON
    where = [f"job_id = {param(query.job_id)}", f"position > {param(query.after)}"]
    if len(query.types) == 1:  # equality keeps the (job_id, type, position) index ordered
        where.append(f"type = {param(query.types[0])}")
    elif query.types:
        where.append(f"type = ANY({param(_array(query.types))})")
    if query.member is not None:
        where.append(f"{MEMBER_EXPRESSION} = {param(query.member)}")
    if query.since is not None:
        where.append(f"recorded_at >= {param(query.since.isoformat())}")
    if query.until is not None:
        where.append(f"recorded_at < {param(query.until.isoformat())}")
    # The limit is written in the statement, not passed: a prepared statement's generic plan
    # assumes a tenth of the rows for a LIMIT it does not know, so PostgreSQL would plan each
    # page again (a custom plan, twice the cost of the page) rather than use it.
    sql = (
        f"SELECT position, {_EVENT_JSON} FROM events WHERE {' AND '.join(where)}"
        f" ORDER BY position LIMIT {int(query.limit) + 1}"
    )
    return sql, params


class PageReader:
    """Pages of events over a few asyncio connections of its own (no thread, no transaction:
    each page is one autocommit query).

    A page is one prepared statement run through the connection's libpq handle
    (``psycopg.AsyncConnection.pgconn``): the parameters go as text and the rows come back
    as the bytes PostgreSQL sent, which go into the answer as they are. Psycopg's cursor
    (adapting each parameter, loading each value, its prepared-statement bookkeeping, a
    timer per wait) cost the API, which answers every page on one thread, a sixth of a page.

    The head of the log has a connection of its own: every request waits for the check of the
    head that the views make now and then (``LiveViews.fresh``), and behind page queries that
    fill the other connections it would wait for one of them."""

    def __init__(
        self, database_url: str, *, size: int = 8, statement_timeout_s: float = 10.0
    ) -> None:
        self._url = libpq_url(database_url)
        # Times are written ISO style (see ``_iso_utc``), text is UTF-8, no query runs away.
        self._options = (
            f"-c statement_timeout={int(statement_timeout_s * 1000)}"
            " -c DateStyle=ISO -c client_encoding=UTF8"
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
            return _Connection(conn)
        except BaseException:
            lane.slots.release()
            raise

    async def _release(self, lane: _Lane, held: _Connection, *, broken: bool = False) -> None:
        conn = held.conn
        try:
            if broken or self._closed:
                await conn.close()  # a broken or interrupted connection is not reused
            elif not conn.closed:
                lane.idle.append(held)
        finally:
            lane.slots.release()

    async def _fetch(self, sql: str, params: Sequence[bytes], lane: _Lane) -> PGresult:
        held = await self._acquire(lane)
        try:
            with translated():
                result = await held.run(sql, params)
        except BaseException:
            await self._release(lane, held, broken=True)
            raise
        await self._release(lane, held)
        return result

    async def page(self, query: EventQuery) -> tuple[list[bytes], int | None]:
        """The page's events as JSON (UTF-8), and the cursor of the next page (None: none
        yet)."""
        sql, params = _page_sql(query)
        result = await self._fetch(sql, params, self._pages)
        limit = query.limit
        rows = result.ntuples
        texts = list(map(result.get_value, range(min(rows, limit)), itertools.repeat(1)))
        if rows <= limit:
            return cast("list[bytes]", texts), None
        return cast("list[bytes]", texts), int(cast("bytes", result.get_value(limit - 1, 0)))

    async def head(self) -> int:
        """The log's last position (``log_head``: one row, never waits for a writer)."""
        result = await self._fetch(_HEAD, (), self._head)
        if not result.ntuples:
            raise SchemaNotMigrated("log_head is empty: run `elasticctl migrate` first")
        return int(cast("bytes", result.get_value(0, 0)))

    async def close(self) -> None:
        """Close the idle connections (those in use close when they come back)."""
        self._closed = True
        for lane in (self._pages, self._head):
            idle, lane.idle = lane.idle, []
            for held in idle:
                await held.conn.close()


#: Statements a connection of a ``PageReader`` keeps prepared (the most recently used).
PREPARED = 64


class _Connection:
    """A connection of a ``PageReader``: psycopg's, used through its libpq handle, and the
    statements prepared on it (by their SQL, most recently used last)."""

    __slots__ = ("_names", "conn", "pgconn", "prepared")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.prepared: OrderedDict[str, bytes] = OrderedDict()
        self._names = itertools.count(1)

    async def run(self, sql: str, params: Sequence[bytes]) -> PGresult:
        """The result of ``sql`` (prepared on first use) with text ``params``; the error it
        ends in raised as psycopg's."""
        name = self.prepared.get(sql)
        if name is None:
            if len(self.prepared) >= PREPARED:
                _, oldest = self.prepared.popitem(last=False)
                self.pgconn.send_query(b"DEALLOCATE " + oldest)
                await _result(self.pgconn)
            name = b"page_%d" % next(self._names)
            self.pgconn.send_prepare(name, sql.encode())
            await _result(self.pgconn)
            self.prepared[sql] = name
        else:
            self.prepared.move_to_end(sql)
        self.pgconn.send_query_prepared(name, params)
        return await _result(self.pgconn)


async def _result(pgconn: PGconn) -> PGresult:
    """The result of the command sent on ``pgconn`` (nonblocking, as psycopg's asyncio
    connections are): what is buffered flushed, then the input read as it comes until libpq
    has no result left; an error result raised (psycopg's exception for its SQLSTATE), a
    broken connection too (psycopg's ``OperationalError``, from libpq)."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():
        await _ready(fd, loop.add_writer, loop.remove_writer)
    last = None
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                if last is None:
                    raise psycopg.InterfaceError("no result from PostgreSQL")
                if last.status not in _OK:
                    raise _error(last)
                return last
            last = result
        await _ready(fd, loop.add_reader, loop.remove_reader)


_OK = frozenset({pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK})


def _error(result: PGresult) -> psycopg.Error:
    message = result.get_error_message("utf-8")
    state = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode("ascii", "replace")
    try:
        return psycopg.errors.lookup(state)(message)
    except KeyError:
        return psycopg.DatabaseError(message)


async def _ready(
    fd: int,
    add: Callable[[int, Callable[[asyncio.Future[None]], None], asyncio.Future[None]], None],
    remove: Callable[[int], object],
) -> None:
    """Until ``fd`` is ready (``add``: the loop's ``add_reader`` or ``add_writer``)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    add(fd, _wake, done)
    try:
        await done
    finally:
        remove(fd)


def _wake(done: asyncio.Future[None]) -> None:
    if not done.done():  # cancelled (the request was), and not yet removed
        done.set_result(None)


class _Lane:
    """Connections of a ``PageReader`` for one use: at most ``size`` in use at once."""

    def __init__(self, size: int) -> None:
        self.slots = asyncio.Semaphore(size)
        #: Connections not in use.
        self.idle: list[_Connection] = []
