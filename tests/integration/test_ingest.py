"""The event spine end to end: real NATS JetStream, the ingest loop, real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import nats.errors
import pytest
import sqlalchemy as sa

from controlplane import bus
from controlplane.app import load_views
from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import StoredEvent
from controlplane.publish import Outgoing
from controlplane.store.port import AppendResult
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from schemas.events import EVENT_ADAPTER
from tests.conftest import requires_owned
from tests.integration.helpers import (
    invalid_messages,
    publish,
    running_controlplane,
    valid_messages,
    wait_until,
)

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("clean_stream")]


async def test_valid_repeated_and_invalid_input(settings, pg_store: PostgresEventStore):
    """10,000 published: 8,800 valid unique, 1,000 repeats, 200 invalid."""
    rng = random.Random(7)
    job = SyntheticJob("job-spine", members=16, seed=7)
    valid = valid_messages(job, 8800)
    invalid = invalid_messages("job-spine", 200, rng)
    # Each message gets a place in the stream: valid ones in order, a repeat somewhere after
    # its original, invalid ones anywhere.
    placed: list[tuple[float, Outgoing]] = [(float(i), m) for i, m in enumerate(valid)]
    for k in range(1000):
        i = rng.randrange(len(valid))
        original = valid[i]
        # Half the repeats lack Nats-Msg-Id, so they get past JetStream's de-duplication and
        # the store must drop them itself.
        repeat = original if k % 2 else Outgoing(original.subject, original.data)
        placed.append((rng.uniform(i + 0.1, len(valid)), repeat))
    placed.extend((rng.uniform(-1, len(valid)), m) for m, _ in invalid)
    stream = [m for _, m in sorted(placed, key=lambda p: p[0])]
    assert len(stream) == 10_000

    async with running_controlplane(settings) as cp:
        await publish(settings.nats_url, stream)
        await wait_until(
            lambda: _member_events(pg_store) >= 8800 and pg_store.count_dead_letters() >= 200,
            60,
            "8,800 events and 200 dead letters",
        )
        await asyncio.sleep(0.5)  # anything extra would show up now
        live_views = cp.views

    everything = pg_store.read()
    assert [s.position for s in everything] == list(range(1, len(everything) + 1))
    stored = [s for s in everything if s.event.source != "controlplane"]
    expected = [EVENT_ADAPTER.validate_json(m.data) for m in valid]
    # Sources publish in order and nothing failed, so the member events are exactly the
    # valid input (the decider adds its own: registration, the first generation).
    assert [s.event for s in stored] == expected

    letters = pg_store.dead_letters(limit=10_000)
    assert len(letters) == 200
    want = Counter(reason for _, reason in invalid)
    got = Counter(next(r for r in want if letter.letter.reason.startswith(r)) for letter in letters)
    assert got == want
    assert all(letter.letter.stream_seq is not None for letter in letters)

    by_position = [
        StoredEvent(s.position, s.recorded_at, e) for s, e in zip(stored, expected, strict=True)
    ]
    assert fold(None, stored) == fold(None, by_position)
    # Invariant 2: the live view equals a fold of the stored log from position 0.
    assert live_views == load_views(pg_store)
    assert live_views["job-spine"].events == len(everything)


async def test_a_fetch_is_appended_in_parts_with_the_deciders_turn_between(settings, pg_store):
    """A fetch of 1,500 messages (a backup's reports, say) is appended, folded and
    acknowledged in parts of ``ingest_part`` messages, and a turn the decider wants meanwhile
    comes after the part under way, not after the whole fetch."""
    settings = settings.model_copy(update={"ingest_part": 100, "ingest_fetch_timeout_s": 1.0})
    job = SyntheticJob("job-parts", members=16, seed=3)
    messages = valid_messages(job, 1500)
    async with running_controlplane(settings) as cp:
        session = cp.ingest
        assert session is not None
        decider = session.decider
        messages_at_turns: list[int] = []
        turn, on_commit = session._turn_of, decider.on_commit

        async def counting_turn() -> None:
            messages_at_turns.append(session.stats.messages)
            await turn()

        def wanting(result: AppendResult) -> None:  # every part wants a turn
            on_commit(result)
            decider.wanted.set()

        session._turn_of = counting_turn
        decider.on_commit = wanting  # type: ignore[method-assign]
        await publish(settings.nats_url, messages)
        await wait_until(lambda: session.stats.messages >= 1500, 60, "1,500 messages")
        stats = session.stats
        views = cp.views
    assert stats.largest <= 100
    assert stats.batches >= 15
    # Turns came between the parts, while the rest of the fetch waited.
    between = [n for n in messages_at_turns if 0 < n < 1500]
    assert len(between) >= 10, messages_at_turns
    assert load_views(pg_store)["job-parts"] == views["job-parts"]


def _member_events(store: PostgresEventStore) -> int:
    """Events in the log that members published (not the decider's)."""
    with store.engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM events WHERE source <> 'controlplane'")
        return int(conn.execute(query).scalar_one())


async def _publish_in_background(url: str, messages: list[Outgoing]) -> asyncio.Task[None]:
    return asyncio.create_task(publish(url, messages, window=500, ack_timeout_s=2.0))


def _assert_exactly(store: PostgresEventStore, messages: list[Outgoing]) -> None:
    """The published member events are stored once each (the decider adds its own)."""
    everything = store.read()
    assert [s.position for s in everything] == list(range(1, len(everything) + 1))
    stored = [s for s in everything if s.event.source != "controlplane"]
    ids = [s.event.event_id for s in stored]
    assert len(ids) == len(set(ids)), "an event was stored twice"
    assert set(ids) == {m.msg_id for m in messages}, "an event was lost"
    assert store.count_dead_letters() == 0


async def test_kill_9_of_the_ingest_process_loses_and_duplicates_nothing(settings, pg_store):
    job = SyntheticJob("job-kill", members=8, seed=1)
    messages = valid_messages(job, 30_000)
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_DATABASE_URL": settings.database_url,
        "ELASTIC_INGEST_ACK_WAIT_S": "2",
        "ELASTIC_INGEST_BATCH": "1000",
        "ELASTIC_LOG_LEVEL": "WARNING",
    }
    cmd = [sys.executable, "-m", "controlplane", "serve"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        publisher = await _publish_in_background(settings.nats_url, messages)
        await wait_until(lambda: pg_store.last_position() >= 5000, 60, "ingest to get going")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = pg_store.last_position()
        assert killed_at < len(messages), "killed too late to mean anything"
        proc = subprocess.Popen(cmd, env=env)
        await asyncio.wait_for(publisher, 120)
        await wait_until(lambda: _member_events(pg_store) >= len(messages), 120, "every event")
        await asyncio.sleep(2.5)  # past ack_wait: redeliveries would land now
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert proc.returncode == 0
    _assert_exactly(pg_store, messages)


async def test_nats_server_restart(services, settings, pg_store):
    requires_owned(services.nats, "NATS")
    job = SyntheticJob("job-nats", members=8, seed=2)
    messages = valid_messages(job, 20_000)
    async with running_controlplane(settings) as cp:
        publisher = await _publish_in_background(settings.nats_url, messages)
        await wait_until(lambda: pg_store.last_position() >= 3000, 60, "ingest to get going")
        services.nats.stop()
        down_at = pg_store.last_position()
        await asyncio.sleep(1.0)
        services.nats.start()
        await asyncio.wait_for(publisher, 120)
        await wait_until(lambda: _member_events(pg_store) >= len(messages), 120, "every event")
        await asyncio.sleep(2.5)
        assert cp.ingest is not None
    assert down_at < len(messages), "restarted too late to mean anything"
    _assert_exactly(pg_store, messages)


async def test_postgres_restart(services, settings, pg_store):
    requires_owned(services.postgres, "PostgreSQL")
    job = SyntheticJob("job-pg", members=8, seed=3)
    messages = valid_messages(job, 20_000)
    async with running_controlplane(settings) as cp:
        publisher = await _publish_in_background(settings.nats_url, messages)
        await wait_until(lambda: pg_store.last_position() >= 3000, 60, "ingest to get going")
        services.postgres.stop()
        await asyncio.sleep(1.5)
        services.postgres.start()
        await asyncio.wait_for(publisher, 120)
        await wait_until(lambda: _member_events(pg_store) >= len(messages), 120, "every event")
        await asyncio.sleep(2.5)
        # The outage was seen: batches retried, or the lock's connection died and ingest restarted.
        assert cp.ingest is not None
        assert cp.ingest.stats.store_retries > 0 or cp.sessions > 1
        live = cp.views
    _assert_exactly(pg_store, messages)
    assert live == fold_jobs({}, pg_store.iter_events())


def test_serve_refuses_an_unmigrated_database(services, empty_database_url):
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": services.nats_url,
        "ELASTIC_DATABASE_URL": empty_database_url,
    }
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "elasticctl migrate" in done.stderr


async def test_a_failure_report_is_handed_over_without_the_linger(settings, monkeypatch):
    """A fetched batch waits ``_LINGER_S`` after its first message for more (here made 1.5 s,
    under the tests' 2 s ack wait), unless a failure report (``member.exited``,
    ``member.fault``) is among them: that one goes to the ingest at once, with what came
    before it."""
    monkeypatch.setattr(bus, "_LINGER_S", 1.5)
    base = "elastic.evt.job-urgent.n0.member"
    heartbeat = Outgoing(f"{base}.member.heartbeat", b"{}")
    nc = await bus.connect(settings)
    try:
        await bus.ensure_stream(nc.jetstream(), settings)
        consumer = bus.EventConsumer(nc, settings)
        await publish(settings.nats_url, [heartbeat])
        started = time.monotonic()
        got = await consumer.fetch(100, 10.0)
        assert time.monotonic() - started >= 1.5  # lingered for more
        assert [d.subject for d in got] == [heartbeat.subject]
        assert await consumer.ack_through(got[-1], consumer.epoch)
        for kind in ("member.exited", "member.fault"):
            await publish(settings.nats_url, [heartbeat])
            fetching = asyncio.ensure_future(consumer.fetch(100, 10.0))
            await asyncio.sleep(0.3)  # the heartbeat is in, the fetch lingers
            started = time.monotonic()
            await publish(settings.nats_url, [Outgoing(f"{base}.{kind}", b"{}")])
            got = await fetching
            assert time.monotonic() - started < 1.0, kind
            assert [d.subject for d in got] == [heartbeat.subject, f"{base}.{kind}"]
            assert await consumer.ack_through(got[-1], consumer.epoch)
    finally:
        await nc.close()


async def test_a_consumer_recreation_cut_short_resumes_from_its_floor(settings):
    """Re-creating the ingest's consumer deletes it and adds it at its ack floor; a server
    that stops answering in between (a clustered stream electing its leader) leaves none.
    The next attempt starts after the floor the first one read, not at the stream's start
    (a week of events read again)."""
    base = "elastic.evt.job-floor.n0.member"
    nc = await bus.connect(settings)
    try:
        await bus.ensure_stream(nc.jetstream(), settings)
        await publish(settings.nats_url, [Outgoing(f"{base}.member.heartbeat", b"{}")] * 10)
        consumer = bus.EventConsumer(nc, settings)
        got = await consumer.fetch(6, 5.0)
        assert len(got) == 6 and await consumer.ack_through(got[-1], consumer.epoch)
        floor = bus.delivery(got[-1].reply)[0]
        await nc.flush()
        real_add = consumer._js.add_consumer
        calls = 0

        async def add_once_unanswered(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise nats.errors.TimeoutError
            return await real_add(*args, **kwargs)

        consumer._js.add_consumer = add_once_unanswered  # type: ignore[method-assign]
        with pytest.raises(nats.errors.TimeoutError):
            await consumer._restart_consumer("a test")
        assert await consumer._consumer_info() is None  # deleted, not added again
        await consumer._restart_consumer("a test")
        info = await consumer._consumer_info()
        assert info is not None and info.config.opt_start_seq == floor + 1
    finally:
        await nc.close()
