import pytest

from controlplane.errors import SchemaNotMigrated
from controlplane.store import migrate
from controlplane.store.postgres import PostgresEventStore, make_engine
from tests.store_contract import EventStoreContract

pytestmark = pytest.mark.services


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    def store(self, pg_store):
        return pg_store


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
    # JSON allows \u0000 in strings; PostgreSQL's jsonb does not. The batch must still land.
    bad = ev.make("member.fault", {"kind": "exception", "detail": "nul \u0000 byte"})
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
