import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from controlplane.core.records import DeadLetter
from controlplane.core.sequence import Cursor
from controlplane.errors import SchemaNotMigrated
from controlplane.store import migrate
from controlplane.store.port import AppendResult, JobHead
from controlplane.store.postgres import AsyncAppender, PostgresEventStore, make_engine
from schemas.events import EnvelopeBase
from tests.factories import Events
from tests.store_contract import EventStoreContract

pytestmark = pytest.mark.services


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    def store(self, pg_store):
        return pg_store


class _ThroughAppenders:
    """``pg_store`` whose appends are made by long-lived ``AsyncAppender``s (the ingest's
    writer, which keeps the cursors it read or wrote), one per thread: so the contract is
    checked with cached cursors, and with writers that do not see each other's caches
    (imports still go through the store)."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store
        self._local = threading.local()
        self._made: list[tuple[asyncio.AbstractEventLoop, AsyncAppender]] = []
        self._lock = threading.Lock()

    def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        made = getattr(self._local, "made", None)
        if made is None:
            made = self._local.made = (asyncio.new_event_loop(), self._store.appender())
            with self._lock:
                self._made.append(made)
        loop, appender = made
        return loop.run_until_complete(
            appender.append(events, dead_letters, expected=expected, encoded=encoded)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> None:
        for loop, appender in self._made:
            loop.run_until_complete(appender.close())
            loop.close()


class TestAsyncAppenderStore(EventStoreContract):
    @pytest.fixture
    def store(self, pg_store: PostgresEventStore) -> Iterator[_ThroughAppenders]:
        through = _ThroughAppenders(pg_store)
        yield through
        through.close()


def _table_cursors(store: PostgresEventStore) -> dict[tuple[str, str, str], Cursor]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT job_id, source, incarnation, last_seq, holes FROM source_cursors")
        ).all()
    return {(j, s, i): Cursor(q, tuple((lo, hi) for lo, hi in h)) for j, s, i, q, h in rows}


def _head_xmin(store: PostgresEventStore) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT xmin::text FROM log_head")).scalar_one())


async def test_the_appenders_cursors_are_the_tables(pg_store: PostgresEventStore):
    """What the appender keeps is what the table holds, valid for the head row it left."""
    ev = Events()
    appender = pg_store.appender()
    try:
        await appender.append([ev.heartbeat("m0", seq=1), ev.heartbeat("m1", seq=1)])
        await appender.append([ev.heartbeat("m0", seq=4)])  # a gap: the cursor has a hole
        await appender.append([ev.heartbeat("m0", seq=2)])  # late, into the hole
        assert appender.cursors.cursors == _table_cursors(pg_store)
        assert appender.cursors.cursors[("job1", "n0/m0", "inc1")] == Cursor(4, ((3, 3),))
        assert appender.cursors.token == _head_xmin(pg_store)
        impostor = ev.heartbeat("m0", seq=2)  # a seq taken: refused, from the kept cursor
        result = await appender.append([impostor])
        assert result.stored == [] and len(result.rejected) == 1
    finally:
        await appender.close()
    assert appender.cursors.token is None and not appender.cursors.cursors


async def test_an_append_by_another_writer_is_seen(pg_store: PostgresEventStore):
    ev = Events()
    appender = pg_store.appender()
    try:
        await appender.append([ev.heartbeat("m0", seq=s) for s in (1, 2, 3)])
        pg_store.append([ev.heartbeat("m0", seq=4)])  # the cache does not know this one
        again = ev.heartbeat("m0", seq=4)
        result = await appender.append([again])
        assert result.stored == [] and len(result.rejected) == 1
        [letter] = pg_store.dead_letters()
        assert "out-of-order seq: 4 after 4" in letter.letter.reason
        assert appender.cursors.cursors == _table_cursors(pg_store)
    finally:
        await appender.close()


async def test_a_cursor_moved_without_a_stored_event_is_seen(pg_store: PostgresEventStore):
    """A writer whose only event proves a duplicate (its id reused under a new seq) stores
    nothing, but takes the seq: it still moves the head row, so the appender reads again."""
    ev = Events()
    appender = pg_store.appender()
    try:
        first = ev.heartbeat("m0", seq=1)
        await appender.append([first])
        reused = ev.heartbeat("m0", seq=2).model_copy(update={"event_id": first.event_id})
        other = pg_store.append([reused])
        assert other.stored == [] and other.duplicates == 1
        result = await appender.append([ev.heartbeat("m0", seq=2)])
        assert result.stored == [] and len(result.rejected) == 1
        assert appender.cursors.cursors == _table_cursors(pg_store)
    finally:
        await appender.close()


def test_unmigrated_database_is_reported(empty_database_url):
    engine = make_engine(empty_database_url, pool_size=1)
    try:
        assert migrate.current_revision(engine) is None
        with pytest.raises(SchemaNotMigrated, match="elasticctl migrate"):
            migrate.check_schema(engine)
        with pytest.raises(SchemaNotMigrated, match="elasticctl migrate"):
            PostgresEventStore(engine).last_position()
    finally:
        engine.dispose()


def test_migrated_database_passes_the_check(database_url):
    engine = make_engine(database_url, pool_size=1)
    migrate.check_schema(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


async def test_bad_text_for_postgres_is_a_store_error_not_a_crash(pg_store: PostgresEventStore):
    from controlplane.errors import StoreError
    from controlplane.ingest import commit
    from tests.factories import Events

    ev = Events()
    good = ev.heartbeat("m0")
    # JSON allows \u0000 in strings; PostgreSQL's jsonb does not. The schemas refuse it now
    # (issue 20); built past them, the store's refusal is still isolated and the batch lands.
    fault = ev.make("member.fault", {"kind": "exception", "detail": "nul byte"})
    bad = fault.model_copy(
        update={"payload": fault.payload.model_copy(update={"detail": "nul \u0000 byte"})}
    )
    later = ev.heartbeat("m0")
    with pytest.raises(StoreError):
        pg_store.append([good, bad, later])
    appender = pg_store.appender()
    try:
        result = await commit(appender, [good, bad, later], [])
    finally:
        await appender.close()
    assert [s.event for s in result.stored] == [good, later]
    [letter] = pg_store.dead_letters()
    assert "refused by the store" in letter.letter.reason
    assert letter.letter.event_id == bad.event_id
