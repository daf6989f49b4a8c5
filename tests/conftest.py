"""Fixtures: real NATS (JetStream) and PostgreSQL, started once per test session.

``ELASTIC_TEST_NATS_URL`` / ``ELASTIC_TEST_DATABASE_URL`` point the tests at external servers
instead (then tests that restart a server are skipped: they cannot restart what they don't own).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import nats
import nats.js.errors
import psycopg
import pytest

from controlplane.devstack import NatsServer, PostgresServer
from controlplane.settings import Settings
from controlplane.store import migrate
from controlplane.store.postgres import PostgresEventStore, make_engine

NATS_ENV = "ELASTIC_TEST_NATS_URL"
DATABASE_ENV = "ELASTIC_TEST_DATABASE_URL"


@dataclass
class Services:
    nats_url: str
    database_url: str
    nats: NatsServer | None
    postgres: PostgresServer | None


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services")
    nats_server = None if os.environ.get(NATS_ENV) else NatsServer(root / "nats").start()
    pg_server = None if os.environ.get(DATABASE_ENV) else PostgresServer(root / "postgres").start()
    try:
        yield Services(
            nats_url=os.environ.get(NATS_ENV) or nats_server.url,  # type: ignore[union-attr]
            database_url=os.environ.get(DATABASE_ENV) or pg_server.url,  # type: ignore[union-attr]
            nats=nats_server,
            postgres=pg_server,
        )
    finally:
        if nats_server is not None:
            nats_server.stop()
        if pg_server is not None:
            pg_server.stop()


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture
def empty_database_url(services: Services) -> Iterator[str]:
    """A fresh database with no schema, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield with_database(services.database_url, name)
    try:
        with psycopg.connect(services.database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.OperationalError:
        pass  # the server was restarted by the test and is gone with the session


@pytest.fixture
def database_url(empty_database_url: str) -> str:
    """A fresh, migrated database for one test."""
    engine = make_engine(empty_database_url, pool_size=1)
    migrate.upgrade(engine)
    engine.dispose()
    return empty_database_url


@pytest.fixture
def pg_store(database_url: str) -> Iterator[PostgresEventStore]:
    store = PostgresEventStore.from_url(database_url)
    yield store
    store.close()


@pytest.fixture
def settings(services: Services, database_url: str) -> Settings:
    """Settings for a service under test: short timeouts, a fresh database."""
    return Settings(
        nats_url=services.nats_url,
        database_url=database_url,
        ingest_ack_wait_s=2.0,
        ingest_fetch_timeout_s=0.2,
        retry_max_s=0.5,
        rendezvous_port=0,
        command_retry_s=0.5,
    )


@pytest.fixture
async def clean_stream(services: Services) -> AsyncIterator[None]:
    """Start the test with no events stream (nor its consumers) on the server."""

    async def drop() -> None:
        nc = await nats.connect(services.nats_url)
        try:
            for stream in (Settings().stream, Settings().command_stream):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()

    await drop()
    yield
    await asyncio.wait_for(drop(), 10)


def requires_owned(server: object, what: str) -> None:
    if server is None:
        pytest.skip(f"{what} is external ({NATS_ENV}/{DATABASE_ENV}); cannot restart it")
