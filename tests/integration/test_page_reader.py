"""The API's page reader (``controlplane.api.sql.PageReader``, on psycopg's pool) against a
real PostgreSQL: its pages are the stored events, its prepared statements stay within their
bound, and a failed, timed-out, dead or interrupted query leaves no connection in a bad state
behind."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest

from controlplane.api import sql
from controlplane.api.app import _page
from controlplane.errors import SchemaNotMigrated, StoreError, StoreUnavailable
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from schemas.api import EventOut, EventPage
from schemas.events import EVENT_ADAPTER

JOB = "job-pages"
EVENTS = 40


@pytest.fixture
def positions(pg_store: PostgresEventStore) -> list[int]:
    job = SyntheticJob(JOB, members=4, racks=2, nodes_per_rack=1, seed=3)
    envelopes = itertools.chain(job.controlplane_events(), job.member_events(EVENTS - 2))
    events = [EVENT_ADAPTER.validate_python(e, strict=False) for e in envelopes]
    return [s.position for s in pg_store.append(events).stored]


@pytest.fixture
async def reader(database_url: str) -> AsyncIterator[sql.PageReader]:
    pages = sql.PageReader(database_url, size=1, statement_timeout_s=1.0)
    yield pages
    await pages.close()


@pytest.fixture
def admin(database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


def page_events(page: sql.Page) -> list[EventOut]:
    """The events of ``page`` as the API sends them (through the schemas)."""
    events = EventPage.model_validate_json(b'{"events":[%s],"next_after":null}' % page.events)
    assert len(events.events) == page.count
    return events.events


async def page_positions(reader: sql.PageReader, **query: object) -> tuple[list[int], int | None]:
    page = await reader.page(sql.EventQuery(job_id=JOB, **query))  # type: ignore[arg-type]
    return [e.position for e in page_events(page)], page.next_after


def available(reader: sql.PageReader) -> int:
    return reader._pages.get_stats().get("pool_available", 0)


async def test_every_shape_of_page_is_prepared_once_and_at_most_the_bound_stay(
    reader: sql.PageReader, positions: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql, "PREPARED", 2)
    for limit in (3, 5, 7, 3, 5, 7, 7, 3):
        got, after = await page_positions(reader, after=positions[1], limit=limit)
        assert got == positions[2 : 2 + limit] and after == got[-1]
    async with reader._pages.connection() as conn:
        cursor = await conn.execute("SELECT statement FROM pg_prepared_statements", prepare=False)
        statements = [bytes(row[0]).decode() for row in await cursor.fetchall()]
    # psycopg keeps the two most recent shapes prepared on the server (the others deallocated).
    on_server = [s for s in statements if "FROM events" in s]
    assert len(on_server) == 2, statements
    assert sorted(re.findall(r"LIMIT (\d+)", s)[0] for s in on_server) == ["4", "8"], on_server
    last, after = await page_positions(reader, after=positions[-3], limit=5)
    assert last == positions[-2:] and after is None


async def test_the_first_pages_asked_for_at_once_all_come(
    database_url: str, positions: list[int]
) -> None:
    """The pools open on first use: concurrent first requests wait for that, none fails."""
    reader = sql.PageReader(database_url, size=2)
    try:
        pages = await asyncio.gather(*(page_positions(reader, limit=3) for _ in range(8)),
                                     reader.head())  # fmt: skip
    finally:
        await reader.close()
    assert all(page == (positions[:3], positions[2]) for page in pages[:-1])
    assert pages[-1] == positions[-1]


async def test_filters_go_as_parameters(reader: sql.PageReader, positions: list[int]) -> None:
    got, _ = await page_positions(reader, types=("member.joined", 'odd "type\\'), limit=100)
    assert len(got) == 4
    got, _ = await page_positions(reader, member="m1", limit=100)
    assert got and len(got) < EVENTS // 2


async def test_every_shape_of_page_is_the_log_filtered(
    reader: sql.PageReader,
    pg_store: PostgresEventStore,
    positions: list[int],
    admin: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Each shape of statement (one type: its positions from the type's index first; several
    types; a member; times) pages as the log filtered in Python (``app._page``, the path of a
    store other than PostgreSQL) does, cursor by cursor: the same events, the same cursors."""
    # Recorded a second apart (one append records them all at once).
    admin.execute("UPDATE events SET recorded_at = recorded_at + position * interval '1 second'")
    stored = pg_store.read(job_id=JOB)
    middle = stored[len(stored) // 2].recorded_at
    shapes: list[dict[str, object]] = [
        {},
        {"types": ("train.step",)},
        {"types": ("member.heartbeat",), "since": middle},
        {"types": ("train.step",), "until": middle},
        {"types": ("member.joined", "train.step")},
        {"member": "m1"},
        {"member": "m1", "types": ("train.step",)},
        {"types": ("job.stopped",)},
    ]
    for shape in shapes:
        every = _page(pg_store, sql.EventQuery(job_id=JOB, limit=1000, **shape))  # type: ignore[arg-type]
        assert every.count or shape == {"types": ("job.stopped",)}, shape
        for limit in (1, 3, 100):
            after, seen = 0, 0
            while True:
                query = sql.EventQuery(job_id=JOB, after=after, limit=limit, **shape)  # type: ignore[arg-type]
                page, expected = await reader.page(query), _page(pg_store, query)
                assert page_events(page) == page_events(expected), (shape, limit, after)
                assert page.next_after == expected.next_after
                seen += page.count
                if page.next_after is None:
                    break
                after = page.next_after
            assert seen == every.count, (shape, limit)


async def test_a_dead_connection_is_unavailable_once_and_then_replaced(
    reader: sql.PageReader, positions: list[int], admin: psycopg.Connection[tuple[object, ...]]
) -> None:
    assert (await page_positions(reader, limit=2))[0] == positions[:2]
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    with pytest.raises(StoreUnavailable):
        await page_positions(reader, limit=2)
    assert available(reader) == 0  # closed, not kept
    assert (await page_positions(reader, limit=2))[0] == positions[:2]
    assert await reader.head() == positions[-1]


async def test_a_query_past_the_statement_timeout_is_a_store_error_and_the_reader_goes_on(
    reader: sql.PageReader, positions: list[int], admin: psycopg.Connection[tuple[object, ...]]
) -> None:
    with admin.transaction():
        admin.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")  # as a migration may
        with pytest.raises(StoreError, match="statement timeout"):
            await page_positions(reader, limit=2)
    assert (await page_positions(reader, limit=2))[0] == positions[:2]


async def test_an_interrupted_page_gives_its_connection_up(
    reader: sql.PageReader, positions: list[int], admin: psycopg.Connection[tuple[object, ...]]
) -> None:
    with admin.transaction():
        admin.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        waiting = asyncio.create_task(page_positions(reader, limit=2))
        await asyncio.sleep(0.2)
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting
    # psycopg cancelled the query on the server: the connection is whole and serves on.
    got = await asyncio.wait_for(page_positions(reader, limit=2), timeout=5)
    assert got[0] == positions[:2]


async def test_an_unmigrated_database_says_to_migrate(empty_database_url: str) -> None:
    reader = sql.PageReader(empty_database_url, size=1)
    try:
        with pytest.raises(SchemaNotMigrated, match="elasticctl migrate"):
            await reader.head()
        with pytest.raises(SchemaNotMigrated):
            await reader.page(sql.EventQuery(job_id=JOB))
    finally:
        await reader.close()


async def test_times_are_utc_whatever_the_time_zone_of_the_session(
    database_url: str,
    pg_store: PostgresEventStore,
    positions: list[int],
    admin: psycopg.Connection[tuple[object, ...]],
) -> None:
    admin.execute(f"ALTER DATABASE \"{admin.info.dbname}\" SET TimeZone = 'America/New_York'")
    reader = sql.PageReader(database_url, size=1)  # new sessions: New York time
    try:
        page = await reader.page(sql.EventQuery(job_id=JOB, limit=EVENTS))
    finally:
        await reader.close()
    stored = pg_store.read(job_id=JOB)
    events = page_events(page)
    assert len(events) == len(stored) == EVENTS
    for got, event in zip(events, stored, strict=True):
        assert (got.position, got.recorded_at) == (event.position, event.recorded_at)
        assert got.emitted_at == event.event.emitted_at
    times = re.findall(rb'"(?:recorded|emitted)_at":"([^"]+)"', page.events)
    assert len(times) == 2 * EVENTS and all(t.endswith(b"Z") and b"+" not in t for t in times)


def test_the_job_goes_json_encoded_into_each_event() -> None:
    assert json.loads(str(sql._page_sql(sql.EventQuery(JOB))[1][0])) == JOB
