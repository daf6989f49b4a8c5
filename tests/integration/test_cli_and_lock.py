"""The migrate command, and one active ingest per database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from controlplane.app import ControlPlane
from controlplane.core.fold import fold
from controlplane.lock import AdvisoryLock
from controlplane.store import migrate
from controlplane.store.postgres import make_engine
from controlplane.synth import SyntheticJob
from tests.integration.helpers import publish, valid_messages, wait_until

pytestmark = pytest.mark.services


def test_migrate_command_is_idempotent(empty_database_url):
    env = {**os.environ, "ELASTIC_DATABASE_URL": empty_database_url}
    cmd = [sys.executable, "-m", "controlplane", "migrate", "--json"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    head = migrate.head_revision()
    assert json.loads(first.stdout) == {"from": None, "to": head}
    assert json.loads(second.stdout) == {"from": head, "to": head}
    engine = make_engine(empty_database_url, pool_size=1)
    migrate.check_schema(engine)
    engine.dispose()


def test_migrate_reports_an_unreachable_database():
    env = {**os.environ, "ELASTIC_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "migration failed" in done.stderr


@pytest.mark.usefixtures("clean_stream")
async def test_a_second_control_plane_stands_by_and_takes_over(settings, pg_store):
    messages = valid_messages(SyntheticJob("job-ha", members=4, seed=9), 400)
    planes = [ControlPlane(settings), ControlPlane(settings)]
    stops = [asyncio.Event(), asyncio.Event()]
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks.append(asyncio.create_task(planes[0].run(stops[0])))
        await wait_until(lambda: planes[0].sessions == 1, 30, "the first to take the lock")
        await publish(settings.nats_url, messages[:200])
        await wait_until(lambda: pg_store.last_position() >= 200, 30, "the leader to ingest")

        tasks.append(asyncio.create_task(planes[1].run(stops[1])))
        await asyncio.sleep(2 * settings.lock_retry_s + 0.5)
        assert planes[1].sessions == 0 and planes[1].ingest is None, "no split brain"

        stops[0].set()
        await asyncio.wait_for(tasks[0], 30)
        await wait_until(lambda: planes[1].sessions == 1, 10, "the standby to take over")
        await publish(settings.nats_url, messages[200:])
        await wait_until(lambda: pg_store.last_position() >= 400, 30, "the successor to ingest")
        await wait_until(
            lambda: planes[1].views["job-ha"].last_position == pg_store.last_position(),
            10,
            "the successor to fold what it wrote",
        )
        stored = pg_store.read(job_id="job-ha")
        assert sum(1 for s in stored if s.event.source != "controlplane") == 400
        # The live view is the fold of the log (the decider's events included).
        assert planes[1].views["job-ha"] == fold(None, stored)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)


async def test_a_standby_takes_the_lock_as_soon_as_its_holder_lets_it_go(empty_database_url):
    holder, standby = AdvisoryLock(empty_database_url), AdvisoryLock(empty_database_url)
    stop = asyncio.Event()
    try:
        assert await holder.try_acquire()
        waiting = asyncio.create_task(standby.acquire(stop, retry_s=5.0))
        await asyncio.sleep(0.5)
        assert not waiting.done(), "no split brain"
        await holder.release()  # as a killed holder's connection ends
        released = time.monotonic()
        assert await asyncio.wait_for(waiting, 10)
        # Within a fraction of the retry interval: it waited inside PostgreSQL.
        assert time.monotonic() - released < 1.0
        assert not await holder.try_acquire()
    finally:
        await holder.release()
        await standby.release()


async def test_a_waiting_standby_stops_when_told(empty_database_url):
    holder, standby = AdvisoryLock(empty_database_url), AdvisoryLock(empty_database_url)
    stop = asyncio.Event()
    try:
        assert await holder.try_acquire()
        waiting = asyncio.create_task(standby.acquire(stop, retry_s=0.2))
        await asyncio.sleep(0.5)
        stop.set()
        assert await asyncio.wait_for(waiting, 5) is False
        assert await holder.held()
    finally:
        await holder.release()
        await standby.release()


@pytest.mark.usefixtures("clean_stream")
async def test_a_leader_that_lost_its_lock_lets_its_successor_have_the_rendezvous_port(settings):
    """PostgreSQL ending the leader's lock connection (a restart does) hands the lock to the
    standby while the old leader still serves the rendezvous on the one port both use: the old
    leader lets the port go once it finds the lock taken, and the new one binds it (it does not
    exit on the port being in use)."""
    import psycopg

    from controlplane.devstack import free_port
    from controlplane.settings import libpq_url

    port = free_port()
    shared = settings.model_copy(update={"rendezvous_port": port, "lock_retry_s": 0.3})
    planes = [ControlPlane(shared), ControlPlane(shared)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(planes[0].run(stop))]
    try:
        await wait_until(lambda: planes[0].sessions == 1, 30, "the first to lead")
        await wait_until(
            lambda: planes[0].rendezvous is not None and planes[0].rendezvous.base is not None,
            10,
            "the leader's rendezvous",
        )
        tasks.append(asyncio.create_task(planes[1].run(stop)))
        await asyncio.sleep(1.0)
        assert planes[1].sessions == 0
        async with await psycopg.AsyncConnection.connect(
            libpq_url(settings.database_url), autocommit=True
        ) as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                " AND granted AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())"
            )
        await wait_until(lambda: planes[1].ingest is not None, 30, "the standby to take over")
        successor = planes[1].rendezvous
        assert successor is not None and successor.base == f"tcp://127.0.0.1:{port}"
        assert planes[0].rendezvous is not None and planes[0].rendezvous.base is None
        await asyncio.sleep(1.0)
        assert not any(task.done() for task in tasks), [t.exception() for t in tasks if t.done()]
        assert planes[0].sessions == 1 and not planes[0].leading
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
